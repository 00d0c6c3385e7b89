"""A remote command that cannot do its work says why, with the exit code a
local one would use, no traceback, and never the token: an API that is not
there, refuses the token, or answers garbage; options that make no sense."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from api.app import create_app
from roundtable.cli import remote as remote_module
from roundtable.cli.endpoint import Endpoint
from roundtable.cli.output import CliError
from roundtable.cli.remote import MAX_ANSWER_BYTES, Remote
from roundtable.cli.sse import TooLong, server_events, stream_lines
from roundtable.config import Settings
from roundtable.store import open_store
from tests.api_server import serving
from tests.dev_stack import free_port, run_cli

TOKEN = "rt_the-secret-token-under-test-0123456789"


def cli(cwd: Path, *args: str, **env: str) -> tuple[int, dict[str, Any], str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("ROUNDTABLE_")}
    done = run_cli(*args, "--json", cwd=cwd, env={**base, **env})
    said = done.stdout + done.stderr
    assert TOKEN not in said, said
    assert "Traceback" not in said, said
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1, said
    return done.returncode, json.loads(lines[0])["error"], said


async def acli(cwd: Path, *args: str, **env: str) -> tuple[int, dict[str, Any], str]:
    return await asyncio.to_thread(cli, cwd, *args, **env)


def test_an_api_nobody_serves_is_unreachable(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    code, error, _ = cli(tmp_path, "show", "run-1", "--api", url, ROUNDTABLE_API_TOKEN=TOKEN)
    assert (code, error["code"]) == (1, "unreachable")
    assert error["message"].startswith(f"cannot reach the API at {url}: ")


@pytest.mark.parametrize(
    ("args", "env", "says"),
    [
        (["--api", "ftp://example.com"], {"ROUNDTABLE_API_TOKEN": TOKEN}, "http:// or https://"),
        (["--api", "not a url"], {"ROUNDTABLE_API_TOKEN": TOKEN}, "http"),
        ([], {"ROUNDTABLE_API_URL": "http://u:p@127.0.0.1:9"}, "no credentials"),
        (["--api", "http://127.0.0.1:9"], {}, "no API token for http://127.0.0.1:9"),
        (["--token", TOKEN], {}, "go with --api"),
        (["--api", "http://127.0.0.1:9", "--token-file", "/no/such/file"], {}, "/no/such/file"),
        (["--api", "http://127.0.0.1:9", "--token", TOKEN + " x"], {}, "spaces"),
    ],
    ids=["scheme", "garbage", "credentials", "no-token", "token-alone", "no-file", "bad-token"],
)
def test_options_that_make_no_sense_are_usage_errors(
    tmp_path: Path, args: list[str], env: dict[str, str], says: str
) -> None:
    code, error, _ = cli(tmp_path, "approvals", *args, **env)
    assert (code, error["code"]) == (2, "usage"), error
    assert says in error["message"]


def test_a_token_in_the_environment_alone_changes_nothing(tmp_path: Path) -> None:
    """Without an API named the command works as it always did: on the database."""
    code, error, _ = cli(tmp_path, "approvals", ROUNDTABLE_API_TOKEN=TOKEN)
    assert (code, error["code"]) == (4, "no_database")


def test_tickets_are_not_served_by_the_api(tmp_path: Path) -> None:
    code, error, _ = cli(
        tmp_path, "tickets", ROUNDTABLE_API_URL="http://127.0.0.1:9", ROUNDTABLE_API_TOKEN=TOKEN
    )
    assert (code, error["code"]) == (2, "usage")
    assert "the API does not serve the demo ticket log" in error["message"]
    assert not (tmp_path / ".roundtable").exists()


async def test_a_refused_token_is_named_and_never_printed(tmp_path: Path) -> None:
    settings = Settings(database_url=f"sqlite+aiosqlite:///{tmp_path / 'rt.db'}")
    async with open_store(settings.database_url) as store:
        app = create_app(settings, store=store)
        async with serving(app) as port:
            url = f"http://127.0.0.1:{port}"
            for command in (["runs"], ["approve", "a-1"], ["events", "r-1", "--follow"]):
                code, error, _ = await acli(
                    tmp_path, *command, "--api", url, ROUNDTABLE_API_TOKEN=TOKEN
                )
                assert (code, error["code"]) == (1, "unauthorized"), (command, error)
                assert f"the API at {url} refused the token" in error["message"]
            codec, _ = await store.create_token(user_id="ui", role="codec")
            code, error, _ = await acli(tmp_path, "runs", "--api", url, ROUNDTABLE_API_TOKEN=codec)
            assert (code, error["code"]) == (1, "forbidden")
            assert error["message"].startswith("the token may not do this")


async def _garbage(scope: dict, receive: Any, send: Any) -> None:
    """A server that is not the Roundtable API, or is a broken or hostile one."""
    if scope["type"] != "http":
        return
    kind = scope["path"].split("/")[1]
    headers = dict(scope["headers"])
    status, content_type, body = {
        "html": (200, b"text/html", b"<html>hello</html>"),
        "crash": (500, b"text/plain", b"Internal Server Error"),
        "shape": (200, b"application/json", b'{"items": "nope", "next_cursor": null}'),
        "binary": (200, b"application/json", b"\xff\xfe\x00garbage"),
        "echo": (
            401,
            b"application/problem+json",
            json.dumps(
                {
                    "type": "x",
                    "title": "x",
                    "status": 401,
                    "code": "unauthorized",
                    "detail": f"you sent {headers.get(b'authorization', b'').decode()}",
                }
            ).encode(),
        ),
        "sse": (200, b"text/event-stream", b"id: 1\nevent: x\ndata: {not json\n\n"),
        "teapot": (
            418,
            b"application/problem+json",
            b'{"type": "x", "title": "x", "status": 418, "code": "teapot", "detail": "short"}',
        ),
    }[kind]
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", content_type)],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def test_garbage_from_the_server_is_a_clear_error(tmp_path: Path) -> None:
    async with serving(_garbage) as port:
        base = f"http://127.0.0.1:{port}"
        for kind, says in (
            ("html", "did not answer with JSON"),
            ("crash", "answered HTTP 500 without a problem document"),
            ("shape", "did not answer with a RunPage (items: "),
            ("binary", "did not answer with JSON"),
        ):
            code, error, _ = await acli(
                tmp_path, "runs", "--api", f"{base}/{kind}", ROUNDTABLE_API_TOKEN=TOKEN
            )
            assert (code, error["code"]) == (1, "bad_response"), (kind, error)
            assert says in error["message"], (kind, error)
        code, error, _ = await acli(
            tmp_path, "runs", "--api", f"{base}/echo", ROUNDTABLE_API_TOKEN=TOKEN
        )
        assert (code, error["code"]) == (1, "unauthorized")
        assert "you sent Bearer [token]" in error["message"]  # scrubbed (cli() checks the rest)
        code, error, _ = await acli(
            tmp_path,
            "events",
            "r-1",
            "--follow",
            "--api",
            f"{base}/sse",
            ROUNDTABLE_API_TOKEN=TOKEN,
        )
        assert (code, error["code"]) == (1, "bad_response"), error
        code, error, _ = await acli(
            tmp_path,
            "events",
            "r-1",
            "--follow",
            "--api",
            f"{base}/html",
            ROUNDTABLE_API_TOKEN=TOKEN,
        )
        assert (code, error["code"]) == (1, "bad_response"), error
        assert "did not answer with an event stream" in error["message"]
        code, error, _ = await acli(
            tmp_path, "runs", "--api", f"{base}/teapot", ROUNDTABLE_API_TOKEN=TOKEN
        )
        assert (code, error["code"]) == (1, "teapot") and "HTTP 418" in error["message"]


# ------------------------------------------------------------ a hostile server
# remote.py: whatever a server sends back has the token taken out before it
# is used or shown; no answer, line or event is read past a cap.


def _bearer(scope: dict) -> str:
    return dict(scope["headers"]).get(b"authorization", b"").decode().removeprefix("Bearer ")


def _run_view(run_id: str, user_id: str, status: str) -> dict[str, Any]:
    at = "2026-01-01T00:00:00+00:00"
    return {
        "run_id": run_id,
        "user_id": user_id,
        "status": status,
        "failure": None,
        "usage": {"turns": 0, "prompt_tokens": 0, "completion_tokens": 0},
        "created_at": at,
        "updated_at": at,
        "actions": [],
        "approvals": [],
    }


async def _echoing(scope: dict, receive: Any, send: Any) -> None:
    """An API that puts the caller's token back wherever the CLI prints: a
    problem's code, an answer's fields and keys (plainly and JSON-escaped),
    the event stream."""
    if scope["type"] != "http":
        return
    token, path = _bearer(scope), scope["path"]
    at = "2026-01-01T00:00:00+00:00"
    if path.startswith("/code/"):
        status, kind = 403, b"application/problem+json"
        body = json.dumps(
            {"type": "x", "title": "x", "status": 403, "code": token, "detail": "no"}
        ).encode()
    elif path.endswith("/events"):
        status, kind = 200, b"text/event-stream"
        event = {
            "seq": 1,
            "event_type": token,
            "payload": {"said": f"you sent {token}", token: 1},
            "created_at": at,
            "hash": "h",
        }
        body = f"id: 1\ndata: {json.dumps(event)}\n\n".encode()
    elif path.endswith("/r-1"):
        status, kind = 200, b"application/json"
        body = json.dumps(_run_view("r-1", token, "completed")).encode()
    else:
        status, kind = 200, b"application/json"
        escaped = "".join(f"\\u{ord(c):04x}" for c in token)  # the token, not its bytes
        row = {"run_id": "r-1", "user_id": "@", "status": "running"}
        body = (
            json.dumps(
                {"items": [{**row, "created_at": at, "updated_at": at}], "next_cursor": None}
            )
            .replace('"@"', f'"{escaped}"')
            .encode()
        )
    await send(
        {"type": "http.response.start", "status": status, "headers": [(b"content-type", kind)]}
    )
    await send({"type": "http.response.body", "body": body})


def _said(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("ROUNDTABLE_")}
    return run_cli(*args, cwd=cwd, env={**base, "ROUNDTABLE_API_TOKEN": TOKEN})


async def test_a_problem_code_echoing_the_token_is_not_printed(tmp_path: Path) -> None:
    """Only a problem's detail was scrubbed: its code became the error's code."""
    async with serving(_echoing) as port:
        url = f"http://127.0.0.1:{port}/code"
        code, error, _ = await acli(tmp_path, "runs", "--api", url, ROUNDTABLE_API_TOKEN=TOKEN)
    assert (code, error["code"]) == (1, "forbidden"), error  # acli: the token nowhere


async def test_answers_and_events_echoing_the_token_are_not_printed(tmp_path: Path) -> None:
    """An answer's values and keys, however escaped, and the event stream's
    data: printed with and without --json, the token is not in them."""
    async with serving(_echoing) as port:
        url = f"http://127.0.0.1:{port}"
        for args in (
            ["runs"],
            ["runs", "--json"],
            ["show", "r-1"],
            ["show", "r-1", "--json"],
            ["events", "r-1", "--follow"],
            ["events", "r-1", "--follow", "--json"],
        ):
            done = await asyncio.to_thread(_said, tmp_path, *args, "--api", url)
            said = done.stdout + done.stderr
            assert done.returncode == 0, (args, said)
            assert TOKEN not in said, (args, said)
            assert "[token]" in done.stdout, (args, said)


@asynccontextmanager
async def _mocked(answer: Any) -> AsyncIterator[Remote]:
    endpoint = Endpoint(url="http://api", token=TOKEN)
    transport = httpx.MockTransport(answer)
    async with httpx.AsyncClient(base_url=endpoint.url, transport=transport) as http:
        yield Remote(endpoint, http)


def _endless(counter: list[int], chunk: bytes, first: bytes = b"") -> Any:
    """128 MiB and more stand for "without end"; ``counter`` counts what was taken."""

    async def chunks() -> AsyncIterator[bytes]:
        if first:
            yield first
        for _ in range((128 << 20) // len(chunk)):
            counter[0] += len(chunk)
            yield chunk

    return chunks()


async def test_an_endless_answer_is_not_read_to_the_end() -> None:
    """The whole body went into memory: no cap (the 60 s timeout is per read)."""
    sent, chunk = [0], b" " * (1 << 20)

    def answer(request: httpx.Request) -> httpx.Response:
        kind = {"content-type": "application/json"}
        return httpx.Response(200, headers=kind, content=_endless(sent, chunk))

    async with _mocked(answer) as remote:
        with pytest.raises(CliError) as refused:
            await remote.run("r-1")
    assert sent[0] <= MAX_ANSWER_BYTES + len(chunk), f"read {sent[0] >> 20} MiB of one answer"
    assert refused.value.code == "bad_response"
    assert "an answer of more than 16 MiB" in str(refused.value)


async def test_an_answer_declared_too_long_is_not_read() -> None:
    sent = [0]

    def answer(request: httpx.Request) -> httpx.Response:
        headers = {"content-type": "application/json", "content-length": str(1 << 30)}
        return httpx.Response(200, headers=headers, content=_endless(sent, b" " * 1024))

    async with _mocked(answer) as remote:
        with pytest.raises(CliError) as refused:
            await remote.runs(None, None, 10)
    assert (refused.value.code, sent[0]) == ("bad_response", 0)


async def test_an_endless_event_stream_line_or_event_is_not_held(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The stream was read with httpx's aiter_lines, which holds a line
    until it ends, however long. Now a line, or an event's data, past the
    cap is refused (the cap made small here: it is the answer's, 16 MiB)."""
    monkeypatch.setattr(remote_module, "MAX_ANSWER_BYTES", 1 << 20)
    for opening, chunk in (
        (b"data: ", b"x" * 4096),  # a line that never ends
        (b"", b"data: x\n" * 512),  # an event that never ends
    ):
        sent = [0]

        def answer(request: httpx.Request, opening=opening, chunk=chunk, sent=sent) -> Any:
            kind = {"content-type": "text/event-stream"}
            return httpx.Response(200, headers=kind, content=_endless(sent, chunk, opening))

        async with _mocked(answer) as remote:
            with pytest.raises(CliError) as refused:
                async for _ in remote.follow("r-1"):
                    pass
        assert refused.value.code == "bad_response", refused.value
        assert "an event-stream line or event of more than 1 MiB" in str(refused.value)
        assert sent[0] <= (1 << 20) + 2 * len(chunk), sent[0] >> 10


async def test_pages_without_end_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A server that answers every page with a new cursor was read forever."""
    monkeypatch.setattr(remote_module, "MAX_PAGES", 5)
    asked: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        asked.append(request)
        at = "2026-01-01T00:00:00+00:00"
        row = {"run_id": "r", "user_id": "u", "status": "running"}
        page = {
            "items": [{**row, "created_at": at, "updated_at": at}],
            "next_cursor": f"c{len(asked)}",
        }
        return httpx.Response(200, json=page)

    async with _mocked(answer) as remote:
        with pytest.raises(CliError) as refused:
            await remote.runs(None, None, 10**9)
    assert refused.value.code == "bad_response"
    assert "a listing of more than 5 pages" in str(refused.value)
    assert len(asked) == 5
    # Pages that move on, each within the cap, but more of them than a listing holds.
    monkeypatch.setattr(remote_module, "MAX_PAGES", 1000)
    monkeypatch.setattr(remote_module, "MAX_LISTING_BYTES", 2000)
    asked.clear()
    async with _mocked(answer) as remote:
        with pytest.raises(CliError) as refused:
            await remote.runs(None, None, 10**9)
    assert refused.value.code == "bad_response" and len(asked) < 20, len(asked)


async def _gzip_garbage(scope: dict, receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    kind = b"text/event-stream" if scope["path"].endswith("/events") else b"application/json"
    headers = [(b"content-type", kind), (b"content-encoding", b"gzip")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": b"not gzip at all"})


async def test_a_garbled_encoding_is_a_bad_response(tmp_path: Path) -> None:
    """httpx.DecodingError is no TransportError: it escaped as the catch-all
    code "error" with zlib's words, on a call and on the event stream."""
    async with serving(_gzip_garbage) as port:
        url = f"http://127.0.0.1:{port}"
        for command in (["runs"], ["events", "r-1", "--follow"]):
            code, error, _ = await acli(
                tmp_path, *command, "--api", url, ROUNDTABLE_API_TOKEN=TOKEN
            )
            assert (code, error["code"]) == (1, "bad_response"), (command, error)
            assert "content-encoding does not decode" in error["message"]


async def _empty_page(scope: dict, receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    kind = [(b"content-type", b"application/json")]
    await send({"type": "http.response.start", "status": 200, "headers": kind})
    await send({"type": "http.response.body", "body": b'{"items": [], "next_cursor": null}'})


async def test_a_token_sent_in_the_clear_to_another_machine_is_warned_of(tmp_path: Path) -> None:
    """http:// to a host that is not this one: a warning on stderr, once,
    never on --json's stdout. 0.0.0.0 is no loopback address, yet Linux
    connects it to this machine: the command still works."""
    async with serving(_empty_page) as port:
        anywhere = "0.0.0.0"  # noqa: S104 (a host to call, not to bind)
        for host, warned in ((anywhere, True), ("127.0.0.1", False), ("localhost", False)):
            done = await asyncio.to_thread(
                _said, tmp_path, "runs", "--json", "--api", f"http://{host}:{port}"
            )
            assert done.returncode == 0, done.stdout + done.stderr
            assert json.loads(done.stdout) == []
            assert done.stderr.count("unencrypted") == (1 if warned else 0), (host, done.stderr)
    assert Endpoint(url="http://api.example.com", token=TOKEN).exposed
    assert Endpoint(url="http://10.0.0.5:8000", token=TOKEN).exposed
    assert not Endpoint(url="https://api.example.com", token=TOKEN).exposed
    assert not Endpoint(url="http://[::1]:8000", token=TOKEN).exposed
    assert not Endpoint(url="http://127.0.0.2:8000", token=TOKEN).exposed


async def test_event_stream_lines_end_as_the_format_says() -> None:
    """The CLI's own line reader (httpx's held an endless line): CRLF, LF or
    CR, a CRLF split between two reads, an unfinished last line dropped."""

    async def chunks(*parts: bytes) -> AsyncIterator[bytes]:
        for part in parts:
            yield part

    async def lines(*parts: bytes) -> list[str]:
        return [line async for line in stream_lines(chunks(*parts), 16)]

    assert await lines(b"a\r\nb\nc\rd\n") == ["a", "b", "c", "d"]
    assert await lines(b"a\r", b"\nb\r", b"c\n", b"\n") == ["a", "b", "c", ""]
    assert await lines(b"caf\xc3", b"\xa9\nunfinished") == ["café"]
    with pytest.raises(TooLong):
        await lines(b"x" * 10, b"x" * 10)
    with pytest.raises(TooLong):
        await lines(b"x" * 17 + b"\n")
    events = [e async for e in server_events(chunks_of("id: 3", "data: a", "data: b", ""), 64)]
    assert [(e.id, e.data) for e in events] == [("3", "a\nb")]


async def chunks_of(*lines: str) -> AsyncIterator[str]:
    for line in lines:
        yield line
