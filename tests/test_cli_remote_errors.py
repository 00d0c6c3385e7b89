"""A remote command that cannot do its work says why, with the exit code a
local one would use, no traceback, and never the token: an API that is not
there, refuses the token, or answers garbage; options that make no sense."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from api.app import create_app
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
# is used or shown.


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
