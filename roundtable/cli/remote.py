"""Operator commands through the HTTP API (roundtable/cli/operator.py): no
database, no Temporal, only a URL and a token.

Answers are held to the API's own schemas (api/schemas.py), and refusals
(RFC 9457 problem documents) become the CLI's exit codes and error codes, so
a command fails the same way whichever way it went. Whatever a server sends
back (answers, refusals, events) has the token taken out of it before it is
used or shown, and no answer, event-stream line or event is read past
MAX_ANSWER_BYTES: a hostile or broken server can neither make the CLI print
the token nor fill its memory.
"""

from __future__ import annotations

import asyncio
import json
import re
import shlex
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, NoReturn
from urllib.parse import quote

import httpx
import typer
from pydantic import TypeAdapter, ValidationError

from api.schemas import (
    ApprovalPage,
    ApprovalView,
    DecisionResult,
    EventPage,
    EventView,
    ProblemDocument,
    ReconcileResult,
    RecoverResult,
    RunPage,
    RunStarted,
    RunView,
)
from roundtable.cli.endpoint import API_TOKEN_VAR, Endpoint
from roundtable.cli.output import (
    EXIT_CONFLICT,
    EXIT_NOT_FOUND,
    EXIT_USAGE,
    CliError,
    usage_error,
)
from roundtable.cli.sse import TooLong, server_events, stream_lines
from roundtable.models import RunInput
from roundtable.states import ApprovalStatus
from roundtable.store import FINAL_RUN_STATUSES

TIMEOUT = httpx.Timeout(60.0, connect=10.0)
# The event stream sends a keep-alive every 15 s: a minute of silence is a dead server.
STREAM_TIMEOUT = httpx.Timeout(10.0, read=60.0)
PAGE = 200  # the API's largest page
STREAM_RETRIES = 3  # a stream cut short is resumed (Last-Event-ID) this many times in a row
MAX_DETAIL = 500  # characters of a server's message shown
MAX_ANSWER_BYTES = 16 << 20  # an answer, an event-stream line or one event: more is refused
MAX_PAGES = 1000  # pages of one listing (200 000 items) ...
MAX_LISTING_BYTES = 128 << 20  # ... and bytes in all: a server that pages on forever is refused
_CODE = re.compile(r"[a-z][a-z0-9_]{0,63}")  # a problem code, as the API makes them
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # not for a terminal


class Remote:
    def __init__(self, endpoint: Endpoint, http: httpx.AsyncClient) -> None:
        self.endpoint, self.http = endpoint, http
        self.via = tuple(endpoint.options())
        self.via_note = endpoint.options_note()

    @classmethod
    @asynccontextmanager
    async def open(cls, endpoint: Endpoint) -> AsyncIterator[Remote]:
        warn_if_exposed(endpoint)
        # Redirects are not followed: the token goes to the URL named, only.
        async with httpx.AsyncClient(
            base_url=endpoint.url,
            headers={"Authorization": f"Bearer {endpoint.token}", "User-Agent": "roundtable-cli"},
            timeout=TIMEOUT,
            follow_redirects=False,
        ) as http:
            yield cls(endpoint, http)

    # ------------------------------------------------------------ commands

    async def start(self, request: RunInput, idempotency_key: str | None = None) -> dict[str, Any]:
        # Only what was asked: the API makes the token's owner the run's owner
        # unless a user was named (which only service tokens may do), and
        # applies its default model unless one was named.
        body = request.model_dump(mode="json", exclude_unset=True)
        # Always a key: a start whose answer is lost can be retried with it,
        # and the API starts the run only if it has not started.
        key = idempotency_key or new_idempotency_key()
        given, status = idempotency_key is not None, 0
        try:
            response, raw = await self._exchange(
                "POST", "/v1/runs", json=body, headers={"Idempotency-Key": key}
            )
            status = response.status_code
            return self._answer(response, raw, RunStarted)
        except httpx.TransportError as exc:
            if isinstance(exc, NEVER_SENT):
                raise self._unreachable(exc) from exc
            reason = self._reason(exc)
            raise CliError(
                f"the API at {self.endpoint.shown} did not answer the start ({reason}): "
                f"the run may have started. {_retry(key, given)}",
                "start_unknown",
                idempotency_key=key,
            ) from exc
        except CliError as exc:
            if 300 <= status < 500:
                raise  # refused: nothing started
            # A server error, or an answer we cannot read: it may have started.
            code = exc.code if exc.code == "unreachable" else "start_unknown"
            raise CliError(
                f"{exc}; the run may have started. {_retry(key, given)}",
                code,
                exc.exit_code,
                idempotency_key=key,
            ) from exc

    async def run(self, run_id: str) -> dict[str, Any]:
        return await self._call("GET", _path("/v1/runs", run_id), RunView)

    async def final_answer(self, run_id: str) -> str | None:
        return None  # the API does not serve the workflow's result

    async def runs(self, status: str | None, user: str | None, limit: int) -> list[dict]:
        params = {"status": status, "user_id": user}
        return await self._pages("/v1/runs", RunPage, params, limit)

    async def approvals(self, run_id: str | None, status: str | None) -> list[dict]:
        if status is not None and status not in set(ApprovalStatus):
            raise usage_error(f"unknown approval status {status!r}")
        if run_id is None:
            return await self._pages("/v1/approvals", ApprovalPage, {"status": status})
        listed = await self._call("GET", _path("/v1/runs", run_id, "approvals"), list[ApprovalView])
        return [a for a in listed if status is None or a["status"] == status]

    async def decide(
        self, approval_id: str, decision: str, reason: str | None, by: str | None
    ) -> dict[str, Any]:
        _no_by(by)
        # The API binds a decision to the arguments it was read with: read
        # them, as `roundtable approvals` would show them, and decide those.
        approval = await self._call("GET", _path("/v1/approvals", approval_id), ApprovalView)
        if not approval["arguments_digest"]:
            raise CliError(f"approval {approval_id} names no arguments digest to decide on")
        body = {"decision": decision, "arguments_digest": approval["arguments_digest"]}
        if reason is not None:
            body["reason"] = reason
        path = _path("/v1/approvals", approval_id, "decision")
        return await self._call("POST", path, DecisionResult, json=body)

    async def reconcile(
        self, action_id: str, outcome: str, note: str, by: str | None
    ) -> dict[str, Any]:
        _no_by(by)
        path = _path("/v1/actions", action_id, "reconcile")
        return await self._call(
            "POST", path, ReconcileResult, json={"outcome": outcome, "note": note}
        )

    async def recover(self, run_id: str, note: str, by: str | None) -> dict[str, Any]:
        _no_by(by)
        path = _path("/v1/runs", run_id, "recover")
        return await self._call("POST", path, RecoverResult, json={"note": note})

    async def events(self, run_id: str) -> list[dict[str, Any]]:
        return await self._pages(_path("/v1/runs", run_id, "events"), EventPage, {})

    async def follow(self, run_id: str) -> AsyncIterator[dict[str, Any]]:
        path, last, breaks, connected = _path("/v1/runs", run_id, "events"), 0, 0, False
        while True:
            headers = {"Accept": "text/event-stream"}
            if last:
                headers["Last-Event-ID"] = str(last)
            try:
                async with self.http.stream(
                    "GET", path, headers=headers, timeout=STREAM_TIMEOUT
                ) as response:
                    connected = True
                    if response.status_code != 200:
                        self._refuse(response, await self._body(response))
                    if not response.headers.get("content-type", "").startswith("text/event-stream"):
                        raise self._bad("an event stream")
                    lines = stream_lines(response.aiter_bytes(), MAX_ANSWER_BYTES)
                    async for sent in server_events(lines, MAX_ANSWER_BYTES):
                        event = self._valid(self._parsed(sent.data), EventView)
                        if event["seq"] <= last:
                            continue  # sent again after a resumption
                        last, breaks = event["seq"], 0
                        yield event
            except httpx.TransportError as exc:
                if not connected or breaks >= STREAM_RETRIES:
                    raise self._unreachable(exc) from exc
            except httpx.DecodingError as exc:
                raise self._garbled() from exc
            except TooLong as exc:
                what = f"an event-stream line or event of more than {_mib()}"
                raise self._too_long(what) from exc
            else:
                # The stream ends when the run has ended, or was cut short.
                if (await self.run(run_id))["status"] in FINAL_RUN_STATUSES:
                    return
                if breaks >= STREAM_RETRIES:
                    raise CliError(f"the event stream from {self.endpoint.shown} kept breaking off")
            breaks += 1
            await asyncio.sleep(1)

    # ------------------------------------------------------------ transport

    async def _pages(
        self, path: str, schema: Any, params: dict[str, Any], limit: int | None = None
    ) -> list[dict[str, Any]]:
        """Every item (or the first ``limit``), a page at a time, within
        MAX_PAGES pages and MAX_LISTING_BYTES in all."""
        items: list[dict[str, Any]] = []
        query = {k: v for k, v in params.items() if v is not None}
        read = 0
        for _ in range(MAX_PAGES):
            want = PAGE if limit is None else min(PAGE, limit - len(items))
            response, raw = await self._request("GET", path, params={**query, "limit": want})
            read += len(raw)
            if read > MAX_LISTING_BYTES:
                break
            page = self._answer(response, raw, schema)
            items += page["items"]
            if page["next_cursor"] is None or (limit is not None and len(items) >= limit):
                return items
            if not page["items"] or page["next_cursor"] == query.get("cursor"):
                raise self._bad("pages that move on")  # or this would never end
            query["cursor"] = page["next_cursor"]
        raise self._too_long(
            f"a listing of more than {MAX_PAGES} pages or {MAX_LISTING_BYTES >> 20} MiB "
            "(narrow it, e.g. with --status)"
        )

    async def _call(self, method: str, path: str, schema: Any, **request: Any) -> Any:
        return self._answer(*await self._request(method, path, **request), schema)

    async def _request(
        self, method: str, path: str, **request: Any
    ) -> tuple[httpx.Response, bytes]:
        try:
            return await self._exchange(method, path, **request)
        except httpx.TransportError as exc:
            raise self._unreachable(exc) from exc

    async def _exchange(
        self, method: str, path: str, **request: Any
    ) -> tuple[httpx.Response, bytes]:
        """The answer and its body (at most MAX_ANSWER_BYTES, decoded);
        httpx.TransportError as it came, for the caller to name."""
        async with self.http.stream(method, path, **request) as response:
            return response, await self._body(response)

    async def _body(self, response: httpx.Response) -> bytes:
        declared = response.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > MAX_ANSWER_BYTES:
            raise self._too_long(f"an answer of more than {_mib()}")
        held = bytearray()
        try:
            async for chunk in response.aiter_bytes():
                held += chunk
                if len(held) > MAX_ANSWER_BYTES:
                    raise self._too_long(f"an answer of more than {_mib()}")
        except httpx.DecodingError as exc:
            raise self._garbled() from exc
        return bytes(held)

    def _answer(self, response: httpx.Response, raw: bytes, schema: Any) -> Any:
        if not response.is_success:
            self._refuse(response, raw)
        content_type = response.headers.get("content-type", "")
        if "json" not in content_type:
            raise self._bad("JSON")
        return self._valid(self._parsed(raw), schema)

    def _parsed(self, raw: str | bytes) -> Any:
        """JSON, with the token taken out of every string in it (keys too)."""
        try:
            return scrubbed(json.loads(raw), self.endpoint)
        except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError
            raise self._bad("JSON") from exc

    def _valid(self, body: Any, schema: Any) -> Any:
        try:
            TypeAdapter(schema).validate_python(body)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = _shown(".".join(str(p) for p in first["loc"]) or "body", self.endpoint)
            raise self._bad(f"a {_name(schema)} ({where[:100]}: {first['msg']})") from exc
        return body

    def _refuse(self, response: httpx.Response, raw: bytes) -> NoReturn:
        raise refusal(response.status_code, raw, self.endpoint)

    def _reason(self, exc: httpx.TransportError) -> str:
        if isinstance(exc, httpx.TimeoutException):
            return "no answer in time"
        return _shown(str(exc), self.endpoint)[:MAX_DETAIL] or type(exc).__name__

    def _unreachable(self, exc: httpx.TransportError) -> CliError:
        return CliError(
            f"cannot reach the API at {self.endpoint.shown}: {self._reason(exc)}", "unreachable"
        )

    def _bad(self, expected: str) -> CliError:
        return CliError(
            f"the API at {self.endpoint.shown} did not answer with {expected}: "
            "is it a Roundtable API?",
            "bad_response",
        )

    def _too_long(self, what: str) -> CliError:
        return CliError(
            f"the API at {self.endpoint.shown} sent {what}, more than the CLI reads: "
            "is it a Roundtable API?",
            "bad_response",
        )

    def _garbled(self) -> CliError:
        return CliError(
            f"the API at {self.endpoint.shown} sent an answer its content-encoding "
            "does not decode: is it a Roundtable API?",
            "bad_response",
        )


# Errors raised before the request went out: nothing reached the server.
NEVER_SENT = (
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.PoolTimeout,
    httpx.UnsupportedProtocol,
)


def new_idempotency_key() -> str:
    return f"cli-{uuid.uuid4().hex}"


def _retry(key: str, given: bool) -> str:
    flag = f"--idempotency-key {shlex.quote(key)}"
    if given:
        return f"Retry the same command (with {flag}): it starts the run only if it did not start."
    return (
        f"Retry safely with the same command and {flag}: "
        "it starts the run only if it did not start."
    )


def _mib() -> str:
    return f"{MAX_ANSWER_BYTES >> 20} MiB"


_exposed_warned = False


def warn_if_exposed(endpoint: Endpoint) -> None:
    """Once, on stderr (never in --json's stdout): a token sent in the clear
    to another machine can be read on the way."""
    global _exposed_warned
    if _exposed_warned or not endpoint.exposed:
        return
    _exposed_warned = True
    typer.echo(
        f"warning: the API token goes to {endpoint.shown} unencrypted (http:// to another "
        "machine): anyone on the way can read it and use it. Use https://.",
        err=True,
    )


def refusal(status: int, raw: bytes, endpoint: Endpoint) -> CliError:
    """An API refusal as the error the same refusal raises locally."""
    where = endpoint.shown
    problem = _problem(raw, endpoint)
    detail = _shown(str((problem or {}).get("detail", "")), endpoint)[:MAX_DETAIL]
    code = str((problem or {}).get("code", ""))
    code = code if _CODE.fullmatch(code) else ""  # the token, or garbage, is no code
    if status == 401:
        return CliError(
            f"the API at {where} refused the token ({detail or 'unauthorized'}): "
            f"check ${API_TOKEN_VAR} or --token-file",
            "unauthorized",
        )
    if problem is None:
        return CliError(
            f"the API at {where} answered HTTP {status} without a problem document: "
            "is it a Roundtable API?",
            "bad_response",
        )
    if status == 404:
        return CliError(detail, code or "not_found", EXIT_NOT_FOUND)
    if status == 409:
        return CliError(detail, code or "conflict", EXIT_CONFLICT)
    if status in (400, 413, 422):
        usage = code in ("validation_error", "invalid_input", "")
        return CliError(detail, "usage" if usage else code, EXIT_USAGE)
    if status == 403:
        return CliError(f"the token may not do this: {detail}", code or "forbidden")
    if code == "temporal_unavailable":
        return CliError(detail, "unreachable")  # as a local command says it
    return CliError(f"the API at {where} failed (HTTP {status}): {detail}", code or "error")


def scrub(text: str, endpoint: Endpoint) -> str:
    """A server's words, without the token in them (a hostile server may echo it)."""
    token = endpoint.token
    for _ in range(3):
        if not token or token not in text:
            return text
        text = text.replace(token, "[token]")
    return "[withheld: it held the token]"  # a token built around the mark itself


def scrubbed(value: Any, endpoint: Endpoint) -> Any:
    """A parsed JSON document with the token taken out of every string, keys too."""
    if isinstance(value, str):
        return scrub(value, endpoint)
    if isinstance(value, list):
        return [scrubbed(v, endpoint) for v in value]
    if isinstance(value, dict):
        return {scrub(k, endpoint): scrubbed(v, endpoint) for k, v in value.items()}
    return value


def _shown(text: str, endpoint: Endpoint) -> str:
    """A server's words as a message prints them: scrubbed, no control characters."""
    return _CONTROL.sub("?", scrub(text, endpoint))


def _problem(raw: bytes, endpoint: Endpoint) -> dict[str, Any] | None:
    try:
        body = scrubbed(json.loads(raw), endpoint)
        ProblemDocument.model_validate(body)
    except (ValueError, RecursionError, ValidationError):
        return None
    return body


def _name(schema: Any) -> str:
    return getattr(schema, "__name__", None) or str(schema)


def _path(base: str, *ids: str) -> str:
    """Ids as one path segment each, whatever they hold ("../", "?", "#")."""
    if not all(ids):
        raise CliError("an empty id names nothing", "not_found", EXIT_NOT_FOUND)
    return "/".join([base, *(quote(p, safe="") for p in ids)])


def _no_by(by: str | None) -> None:
    if by is not None:
        raise usage_error("--by: through the API the decision is the token owner's")
