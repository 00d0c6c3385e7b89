"""`roundtable start`: what a start sends, that a start whose answer was lost
can be retried without starting a second run (directly and through the API),
and that `--wait` never loses sight of the run it started."""

from __future__ import annotations

import asyncio
import json
import os
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from roundtable.cli import remote as remote_module
from roundtable.cli.endpoint import Endpoint, resolve
from roundtable.cli.output import CliError
from roundtable.cli.remote import Remote
from roundtable.cli.runs import build_request
from roundtable.config import Settings
from roundtable.models import ScriptDocument
from roundtable.permissions import Authority
from tests.api_server import serving
from tests.dev_stack import run_cli
from tests.test_cli_remote_errors import TOKEN, _run_view, acli
from tests.workflow_harness import harness

Seen = list[tuple[str, str, dict[bytes, bytes], bytes]]


def _api(seen: Seen, polls: list[tuple[int, bytes, bytes]] | None = None) -> Any:
    """A Roundtable-shaped API that starts run r-1 and answers its polls with
    ``polls`` in turn (status, content type, body), the last one for ever."""
    polls = polls or [(200, b"application/json", json.dumps(_run_view("r-1", "u", "completed")))]

    async def app(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = b""
        if scope["method"] == "POST":
            body = (await receive()).get("body", b"")
        seen.append((scope["method"], scope["path"], dict(scope["headers"]), body))
        if scope["method"] == "POST" and scope["path"] == "/v1/runs":
            status, kind = 201, b"application/json"
            answer = json.dumps({"run_id": "r-1", "workflow_id": "r-1", "status": "pending"})
        else:
            status, kind, answer = polls.pop(0) if len(polls) > 1 else polls[0]
        await send(
            {"type": "http.response.start", "status": status, "headers": [(b"content-type", kind)]}
        )
        await send({"type": "http.response.body", "body": _bytes(answer)})

    return app


def _bytes(text: str | bytes) -> bytes:
    return text if isinstance(text, bytes) else text.encode()


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROUNDTABLE_")}
    return {**env, "ROUNDTABLE_API_TOKEN": TOKEN}


async def _start(cwd: Path, *args: str) -> tuple[int, Any, str]:
    done = await asyncio.to_thread(run_cli, "start", "--task", "t", *args, cwd=cwd, env=_env())
    said = done.stdout + done.stderr
    assert TOKEN not in said and "Traceback" not in said, said
    return done.returncode, json.loads(done.stdout) if "--json" in args else None, done.stderr


# ------------------------------------------------------------ what a start sends


async def test_a_remote_start_carries_an_idempotency_key(tmp_path: Path) -> None:
    """POST /v1/runs takes an Idempotency-Key; the CLI sent none. Now every
    start has one: a new one each time, or the one given."""
    seen: Seen = []
    async with serving(_api(seen)) as port:
        url = f"http://127.0.0.1:{port}"
        for extra in ([], [], ["--idempotency-key", "order-42"]):
            code, started, _ = await _start(tmp_path, "--api", url, "--json", *extra)
            assert (code, started["run_id"]) == (0, "r-1"), started
    keys = [headers.get(b"idempotency-key", b"").decode() for m, _, headers, _ in seen]
    assert all(re.fullmatch(r"cli-[0-9a-f]{32}", k) for k in keys[:2]), keys
    assert keys[0] != keys[1] and keys[2] == "order-42", keys


async def test_a_remote_start_sends_only_what_was_asked(tmp_path: Path) -> None:
    """--model defaulted to "scripted", so the API's ROUNDTABLE_DEFAULT_MODEL
    never applied; and the script validation derives ({}) went along."""
    seen: Seen = []
    script = tmp_path / "script.json"
    script.write_text(json.dumps({"turns": [], "final": "done"}))
    async with serving(_api(seen)) as port:
        url = f"http://127.0.0.1:{port}"
        assert (await _start(tmp_path, "--api", url, "--json"))[0] == 0
        given = ["--model", "scripted", "--script", str(script), "--rounds", "2"]
        assert (await _start(tmp_path, "--api", url, "--json", *given))[0] == 0
    plain, chosen = (json.loads(body) for _, _, _, body in seen)
    # The options' own defaults (seats, rounds, mode, policy, timeout) are the
    # API's; the model and the owner are the server's to choose.
    assert not {"model", "script", "user_id", "run_id"} & set(plain), plain
    assert chosen["model"] == "scripted" and chosen["script"]["final"] == "done", chosen
    assert chosen["max_rounds"] == 2


def test_a_start_without_a_model_gets_the_default_model_directly_too() -> None:
    """Directly (no API) the request goes through the same Authority.admit:
    no --model means ROUNDTABLE_DEFAULT_MODEL if set, else scripted with an
    empty script (README: the model of a run that names none)."""
    request = build_request(task_text="t")
    assert request.model_fields_set == {"task_text", "manager"}
    assert request.model == "scripted" and request.script == ScriptDocument()
    plain = Authority.from_settings(Settings()).admit("operator", request)
    assert plain.model == "scripted" and plain.script == ScriptDocument()
    chosen = Authority.from_settings(Settings(default_model="openai:m")).admit("operator", request)
    assert chosen.model == "openai:m"
    named = build_request(task_text="t", model="scripted")
    assert "model" in named.model_fields_set
    assert Authority.from_settings(Settings(default_model="openai:m")).admit(
        "operator", named
    ).model == ("scripted")


async def test_a_malformed_idempotency_key_is_a_usage_error(tmp_path: Path) -> None:
    for key in ("two words", "x" * 256, ""):
        code, error, _ = await acli(
            tmp_path,
            "start",
            "--task",
            "t",
            "--idempotency-key",
            key,
            "--api",
            "http://127.0.0.1:9",
        )
        assert (code, error["code"]) == (2, "usage"), (key, error)


# ------------------------------------------------------------ a lost answer


@asynccontextmanager
async def _hanging_up(seen: list[bytes]) -> AsyncIterator[int]:
    """A server that reads the whole request, then hangs up without an answer
    (a crash, a reset, a proxy's timeout): the run may well have started."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = re.search(rb"(?i)content-length: *(\d+)", head)
        seen.append(head + await reader.readexactly(int(length.group(1)) if length else 0))
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    async with server:
        yield server.sockets[0].getsockname()[1]


def _key(request: bytes) -> str:
    found = re.search(rb"(?i)\r\nidempotency-key: *([^\r]*)\r\n", request)
    assert found, request
    return found.group(1).decode()


async def test_a_start_whose_answer_is_lost_says_how_to_retry_safely(tmp_path: Path) -> None:
    """The answer was lost after the start was sent: "cannot reach the API"
    invited a plain retry, a second run doing every write again. Now the
    error says the run may have started and names the key to retry with."""
    seen: list[bytes] = []
    async with _hanging_up(seen) as port:
        url = f"http://127.0.0.1:{port}"
        code, error, _ = await acli(tmp_path, "start", "--task", "t", "--api", url, **_env())
        assert (code, error["code"]) == (1, "start_unknown"), error
        key = _key(seen[0])
        assert error["idempotency_key"] == key
        assert "the run may have started" in error["message"]
        assert (
            f"Retry safely with the same command and --idempotency-key {key}" in (error["message"])
        )
        # Retried as told: the same key goes again, and the message knows it was given.
        code, error, _ = await acli(
            tmp_path, "start", "--task", "t", "--api", url, "--idempotency-key", key, **_env()
        )
        assert (code, error["code"], _key(seen[1])) == (1, "start_unknown", key), error
        assert f"Retry the same command (with --idempotency-key {key})" in error["message"]
        done = await asyncio.to_thread(
            run_cli, "start", "--task", "t", "--api", url, cwd=tmp_path, env=_env()
        )  # without --json: the same words on stderr
        assert done.returncode == 1 and "the run may have started" in done.stderr, done.stderr


async def test_a_start_answered_by_a_server_error_may_have_started(tmp_path: Path) -> None:
    """A 5xx (a proxy's bad gateway) after the start was sent: the same; a
    refusal (4xx) started nothing and says only why."""

    def answering(status: int, kind: bytes, body: bytes) -> Any:
        async def app(scope: dict, receive: Any, send: Any) -> None:
            if scope["type"] != "http":
                return
            await receive()
            headers = [(b"content-type", kind)]
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": body})

        return app

    problem = {"type": "x", "title": "x", "status": 422, "code": "validation_error"}
    for app, says in (
        (answering(502, b"text/html", b"<html>bad gateway</html>"), ("start_unknown", True)),
        (answering(201, b"application/json", b"{garbled"), ("start_unknown", True)),
        (
            answering(
                422,
                b"application/problem+json",
                json.dumps({**problem, "detail": "seats: bad"}).encode(),
            ),
            ("usage", False),
        ),
    ):
        async with serving(app) as port:
            code, error, _ = await acli(
                tmp_path, "start", "--task", "t", "--api", f"http://127.0.0.1:{port}", **_env()
            )
        assert code != 0
        assert (error["code"], "may have started" in error["message"]) == says, error


async def test_which_failures_of_a_start_may_have_started_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Refused before it was sent (no connection): cannot reach, nothing
    started. Sent, then no answer, or one too long or garbled: it may have."""
    monkeypatch.setattr(remote_module, "MAX_ANSWER_BYTES", 1024)
    for failure, code in (
        (httpx.ConnectError("refused"), "unreachable"),
        (httpx.ConnectTimeout("slow"), "unreachable"),
        (httpx.ReadTimeout("slow"), "start_unknown"),
        (httpx.RemoteProtocolError("hung up"), "start_unknown"),
        (httpx.Response(201, json={"run_id": "r" * 2048}), "start_unknown"),
        (
            httpx.Response(
                201, headers={"content-encoding": "gzip"}, stream=httpx.ByteStream(b"garbled")
            ),
            "start_unknown",
        ),
    ):

        def answer(request: httpx.Request, failure: Any = failure) -> httpx.Response:
            if isinstance(failure, Exception):
                raise failure
            return failure

        endpoint = Endpoint(url="http://api", token=TOKEN)
        transport = httpx.MockTransport(answer)
        async with httpx.AsyncClient(base_url=endpoint.url, transport=transport) as http:
            with pytest.raises(CliError) as failed:
                await Remote(endpoint, http).start(build_request(task_text="t"), "k-1")
        assert failed.value.code == code, (failure, failed.value)
        if code == "start_unknown":
            assert failed.value.fields == {"idempotency_key": "k-1"}
            assert "Retry the same command (with --idempotency-key k-1)" in str(failed.value)


def test_printed_commands_say_where_their_token_comes_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A token given with --token is never printed, so a printed command
    reads $ROUNDTABLE_API_TOKEN: the note says to export it first."""
    monkeypatch.delenv("ROUNDTABLE_API_URL", raising=False)
    monkeypatch.setenv("ROUNDTABLE_API_TOKEN", TOKEN)
    url = "http://127.0.0.1:9"
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    flag = resolve(url, TOKEN, None)
    env = resolve(url, None, None)
    in_file = resolve(url, None, token_file)
    assert flag.options() == env.options() == ["--api", url]
    assert "export ROUNDTABLE_API_TOKEN first" in flag.options_note()
    assert "$ROUNDTABLE_API_TOKEN, as this one did" in env.options_note()
    assert in_file.options() == ["--api", url, "--token-file", str(token_file.resolve())]
    assert in_file.options_note() is None
    for endpoint in (flag, env, in_file):
        assert TOKEN not in " ".join(endpoint.options()) + (endpoint.options_note() or "")


# ------------------------------------------------------------ directly: the key names the run


async def test_a_local_start_with_the_same_key_starts_one_run(tmp_path: Path) -> None:
    """Directly, --idempotency-key gives the run id the API would give
    (operations.idempotent_run_id): the same command again answers with the
    same run and starts nothing; another request under the key is a conflict."""
    async with harness(tmp_path) as h:
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("ROUNDTABLE_API_")},
            "ROUNDTABLE_DATABASE_URL": f"sqlite+aiosqlite:///{tmp_path / 'roundtable.db'}",
            "ROUNDTABLE_TEMPORAL_ADDRESS": h.client.service_client.config.target_host,
            "ROUNDTABLE_TASK_QUEUE": h.task_queue,
        }

        async def start(*args: str) -> tuple[int, Any]:
            done = await asyncio.to_thread(run_cli, "start", *args, "--json", cwd=tmp_path, env=env)
            return done.returncode, json.loads(done.stdout)

        first = await start("--task", "t", "--idempotency-key", "order-42")
        again = await start("--task", "t", "--idempotency-key", "order-42")
        other = await start("--task", "t", "--idempotency-key", "order-43")
        assert first[0] == again[0] == other[0] == 0, (first, again, other)
        assert first[1]["run_id"] == again[1]["run_id"] != other[1]["run_id"]
        assert len(first[1]["run_id"]) <= 64
        code, error = await start("--task", "something else", "--idempotency-key", "order-42")
        assert (code, error["error"]["code"]) == (3, "conflict"), error
        runs = await h.store.list_runs(limit=10)
        assert sorted(r["id"] for r in runs) == sorted({first[1]["run_id"], other[1]["run_id"]}), (
            runs
        )


# ------------------------------------------------------------ --wait keeps the run in sight

BAD_GATEWAY = (502, b"text/html", b"<html>bad gateway</html>")


async def test_start_wait_json_names_the_started_run_when_following_fails(tmp_path: Path) -> None:
    """The run is started, then every poll of its view fails: stdout's one
    document was an error without the run id, so a script could not tell
    "not started" from "started, lost sight of it" (and started another)."""
    seen: Seen = []
    async with serving(_api(seen, [BAD_GATEWAY])) as port:
        url = f"http://127.0.0.1:{port}"
        code, error, _ = await acli(
            tmp_path, "start", "--task", "t", "--wait", "--api", url, **_env()
        )
        assert (code, error["code"], error["run_id"]) == (1, "bad_response", "r-1"), error
        assert error["message"].startswith("run r-1 was started, but waiting for it failed: ")
        assert f"roundtable show r-1 --api {url}" in error["message"]
        assert len([p for m, p, _, _ in seen if m == "GET"]) == 4  # three tries again
        done = await asyncio.to_thread(
            run_cli, "start", "--task", "t", "--wait", "--api", url, cwd=tmp_path, env=_env()
        )
    assert done.returncode == 1
    assert "error: run r-1 was started, but waiting for it failed" in done.stderr, done.stderr


async def test_start_wait_outlasts_a_passing_failure(tmp_path: Path) -> None:
    """One poll answered by a proxy's 502 is tried again, not the end."""
    seen: Seen = []
    view = json.dumps(_run_view("r-1", "u", "completed")).encode()
    polls = [BAD_GATEWAY, (200, b"application/json", view)]
    async with serving(_api(seen, polls)) as port:
        code, ended, _ = await _start(
            tmp_path, "--wait", "--json", "--api", f"http://127.0.0.1:{port}"
        )
    assert (code, ended["run_id"], ended["status"]) == (0, "r-1", "completed"), ended
