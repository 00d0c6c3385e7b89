"""Operator commands through the HTTP API, from a directory with no database
and no Temporal: the real app on uvicorn, a real worker on the time-skipping
server, the real `roundtable` command as its own process."""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest

from tests.api_server import Api, serve_api
from tests.dev_stack import CLI, free_port, run_cli
from tests.test_api import ONE_WRITE, pending_approval, start
from tests.workflow_harness import harness, script, ticket_call


def anywhere_env(**extra: str) -> dict[str, str]:
    """An operator's shell far from the stack: no database, no Temporal, no
    action secret; only what the API needs."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROUNDTABLE_")}
    env["ROUNDTABLE_TEMPORAL_ADDRESS"] = f"127.0.0.1:{free_port()}"  # nobody listens
    return {**env, **extra}


class Operator:
    """`roundtable …` through the API as one operator, from ``cwd``."""

    def __init__(self, api: Api, who: str, cwd: Path) -> None:
        self.url = str(api.http.base_url).rstrip("/")
        self.token, self.cwd = api.tokens[who], cwd
        cwd.mkdir(exist_ok=True)

    def env(self) -> dict[str, str]:
        return anywhere_env(ROUNDTABLE_API_URL=self.url, ROUNDTABLE_API_TOKEN=self.token)

    async def __call__(self, *args: str) -> tuple[int, Any]:
        done = await asyncio.to_thread(run_cli, *args, "--json", cwd=self.cwd, env=self.env())
        assert self.token not in done.stdout + done.stderr
        assert "Traceback" not in done.stderr, done.stderr
        lines = done.stdout.strip().splitlines()
        assert len(lines) == 1, (done.stdout, done.stderr)
        return done.returncode, json.loads(lines[0])


async def test_runs_events_and_a_remote_approve_over_http(tmp_path: Path) -> None:
    async with harness(tmp_path) as h, serve_api(h) as api:
        ops = Operator(api, "ops", tmp_path / "elsewhere")
        started = await start(api, who="alice")
        run_id = started["run_id"]
        approval = await pending_approval(api, run_id)

        code, runs = await ops("runs")
        assert code == 0 and [r["run_id"] for r in runs] == [run_id]
        assert set(runs[0]) == {"run_id", "user_id", "status", "created_at", "updated_at"}
        assert (await ops("runs", "--status", "waiting_input"))[1][0]["run_id"] == run_id
        assert (await ops("runs", "--status", "completed")) == (0, [])
        assert (await ops("runs", "--user", "alice"))[1][0]["user_id"] == "alice"
        assert (await ops("runs", "--user", "bob")) == (0, [])
        code, bad = await ops("runs", "--status", "sideways")
        assert code == 2 and bad["error"]["code"] == "usage"

        code, pending = await ops("approvals", "--run", run_id, "--status", "pending")
        assert code == 0 and [a["id"] for a in pending] == [approval["id"]]
        assert (await ops("approvals", "--status", "pending"))[1] == pending
        code, shown = await ops("show", run_id)
        assert code == 0 and shown["status"] == "waiting_input"
        assert shown["approvals"][0]["id"] == approval["id"] and shown["final_answer"] is None

        # Follow the run's events from before the decision to the run's end.
        follower = threading.Thread(target=lambda: follows.append(_follow(ops, run_id)))
        follows: list[subprocess.CompletedProcess] = []
        follower.start()
        await asyncio.sleep(1)
        code, done = await ops("approve", approval["id"], "--reason", "looks right")
        assert (code, done["status"]) == (0, "approved")
        assert set(done) == {"approval_id", "run_id", "action_id", "status"}
        code, again = await ops("approve", approval["id"])
        assert (code, again["error"]["code"]) == (3, "conflict")
        code, missing = await ops("approve", "no-such-approval")
        assert (code, missing["error"]["code"]) == (4, "not_found")
        code, by = await ops("approve", approval["id"], "--by", "someone-else")
        assert (code, by["error"]["code"]) == (2, "usage")

        await asyncio.to_thread(follower.join, 60)
        (followed,) = follows
        assert followed.returncode == 0, followed.stderr
        streamed = [json.loads(line) for line in followed.stdout.splitlines()]
        seqs = [e["seq"] for e in streamed]
        assert seqs == list(range(1, len(seqs) + 1))
        assert "approval.requested" in [e["event_type"] for e in streamed]
        assert streamed[-1]["payload"]["to"] == "completed"  # ended with the run

        code, events = await ops("events", run_id)
        assert code == 0 and events == streamed
        run = (await api.http.get(f"/v1/runs/{run_id}", headers=api.auth("ops"))).json()
        assert run["status"] == "completed"
        assert run["approvals"][0]["decided_by"] == "ops"  # the token's owner
        assert run["approvals"][0]["decision_reason"] == "looks right"
        code, gone = await ops("events", "no-such-run")
        assert (code, gone["error"]["code"]) == (4, "not_found")
        assert not (ops.cwd / ".roundtable").exists()  # nothing made where it ran


def _follow(ops: Operator, run_id: str) -> subprocess.CompletedProcess:
    return run_cli("events", run_id, "--follow", "--json", cwd=ops.cwd, env=ops.env(), timeout=90)


async def test_local_and_remote_print_the_same_documents(tmp_path: Path) -> None:
    async with harness(tmp_path) as h, serve_api(h) as api:
        ops = Operator(api, "ops", tmp_path / "elsewhere")
        run_id = (await start(api, who="alice"))["run_id"]
        await pending_approval(api, run_id)
        local_env = {
            **os.environ,
            "ROUNDTABLE_DATABASE_URL": f"sqlite+aiosqlite:///{tmp_path / 'roundtable.db'}",
            "ROUNDTABLE_TEMPORAL_ADDRESS": h.client.service_client.config.target_host,
            "ROUNDTABLE_TASK_QUEUE": h.task_queue,
        }
        for command in (
            ["show", run_id],
            ["approvals"],
            ["approvals", "--run", run_id, "--status", "pending"],
            ["runs"],
            ["runs", "--user", "alice", "--status", "waiting_input"],
            ["events", run_id],
        ):
            local = await asyncio.to_thread(
                run_cli, *command, "--json", cwd=tmp_path, env=local_env
            )
            assert local.returncode == 0, local.stdout + local.stderr
            code, remote = await ops(*command)
            assert code == 0
            assert _keys(json.loads(local.stdout)) == _keys(remote), command
        # And they fail alike.
        for command in (
            ["show", "no-such-run"],
            ["approvals", "--run", "no-such-run"],
            ["approvals", "--status", "sideways"],
            ["events", "no-such-run"],
            ["approve", "no-such-approval"],
            ["reject", "no-such-approval", "--reason", "no"],
            ["reconcile", "no-such-action", "--outcome", "failed", "--note", "checked"],
            ["recover", "no-such-run", "--note", "stalled"],
            ["recover", run_id, "--note", "stalled"],  # it replays: nothing to recover
        ):
            local = await asyncio.to_thread(
                run_cli, *command, "--json", cwd=tmp_path, env=local_env
            )
            code, remote = await ops(*command)
            assert code == local.returncode != 0, (command, local.stdout, remote)
            assert remote["error"]["code"] == json.loads(local.stdout)["error"]["code"], command


def _keys(document: Any) -> Any:
    if isinstance(document, list):
        return [_keys(d) for d in document]
    if isinstance(document, dict):
        return {k: _keys(v) for k, v in document.items() if k not in ("arguments", "payload")}
    return None


async def test_remote_reconcile_of_an_unknown_outcome(tmp_path: Path) -> None:
    def drop_t13(_: Any, tickets: Any) -> None:
        tickets.drop_after_write = frozenset({"T-13"})

    drops = script(("seat-1", 1, [ticket_call("ticket_update", "T-13")]), final="done")
    async with harness(tmp_path, customize=drop_t13) as h, serve_api(h) as api:
        ops = Operator(api, "ops", tmp_path / "elsewhere")
        run_id = (await start(api, who="alice", script=drops))["run_id"]
        approval = await pending_approval(api, run_id)
        assert (await ops("approve", approval["id"]))[0] == 0
        for _ in range(200):
            code, view = await ops("show", run_id)
            if view["actions"][0]["status"] == "unknown":
                break
            await asyncio.sleep(0.1)
        action_id = view["actions"][0]["id"]
        code, refused = await ops("reconcile", action_id, "--outcome", "maybe", "--note", "x")
        assert (code, refused["error"]["code"]) == (2, "usage")
        code, settled = await ops(
            "reconcile", action_id, "--outcome", "succeeded", "--note", "T-13 shows it"
        )
        assert (code, settled["status"]) == (0, "succeeded"), settled
        code, again = await ops("reconcile", action_id, "--outcome", "failed", "--note", "x")
        assert (code, again["error"]["code"]) == (3, "conflict")
        code, missing = await ops("reconcile", "no-such", "--outcome", "failed", "--note", "x")
        assert (code, missing["error"]["code"]) == (4, "not_found")


@pytest.mark.parametrize("given", ["token-file", "token"])
async def test_remote_start_wait_tells_each_approval_with_a_command_that_works(
    tmp_path: Path, given: str
) -> None:
    """`start --wait` prints the run id at once; while it waits, each
    approval with the command to decide it, and that command works as printed
    from another directory: its token from the same file, never on the line.
    A token given with --token is not printed either: the command reads
    $ROUNDTABLE_API_TOKEN, and a note says to export it (it failed with "no
    API token" and no word why)."""
    async with harness(tmp_path) as h, serve_api(h) as api:
        token_file = tmp_path / "ops-token"
        token_file.write_text(api.tokens["ops"] + "\n")
        run_script = tmp_path / "script.json"
        run_script.write_text(json.dumps(ONE_WRITE))
        url = str(api.http.base_url).rstrip("/")
        here = tmp_path / "here"
        here.mkdir()
        token = ("--token-file", str(token_file))
        if given == "token":
            token = ("--token", api.tokens["ops"])
        waiting = subprocess.Popen(  # noqa: ASYNC220 (read by a thread below)
            [
                *(CLI, "start", "--task", "t", "--script", str(run_script), "--wait", "--json"),
                *("--api", url, *token),
            ],
            cwd=here,
            env=anywhere_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        told: list[str] = []
        reader = threading.Thread(target=lambda: told.extend(iter(waiting.stderr.readline, "")))
        reader.start()
        try:
            command = await _printed(told, "  approve: ")
            assert told[0].startswith("started run run-"), told
            assert api.tokens["ops"] not in "".join(told)
            noted = [line for line in told if "ROUNDTABLE_API_TOKEN" in line]
            if given == "token":
                assert "--token" not in command, command
                assert len(noted) == 1 and "export ROUNDTABLE_API_TOKEN first" in noted[0], told
            else:
                assert "--token-file" in command and not noted, told
            elsewhere = tmp_path / "elsewhere"
            elsewhere.mkdir()
            # As the note says: the token exported (a file's is named on the line).
            exported = {"ROUNDTABLE_API_TOKEN": api.tokens["ops"]} if given == "token" else {}
            decided = await asyncio.to_thread(
                subprocess.run,
                shlex.split(command),
                cwd=elsewhere,
                env=anywhere_env(**exported),
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            assert decided.returncode == 0, decided.stdout + decided.stderr
            out, _ = await asyncio.to_thread(waiting.communicate, timeout=90)
        finally:
            if waiting.poll() is None:
                waiting.kill()
            await asyncio.to_thread(reader.join, 10)
        assert waiting.returncode == 0, "".join(told)
        result = json.loads(out)
        assert result["status"] == "completed" and result["run_id"] in told[0]
        assert set(result) == {"run_id", "workflow_id", "status", "final_answer"}


async def _printed(lines: list[str], prefix: str, within: float = 60) -> str:
    for _ in range(int(within * 10)):
        for line in list(lines):
            if line.startswith(prefix):
                return line[len(prefix) :].strip()
        await asyncio.sleep(0.1)
    raise AssertionError(f"no {prefix!r} in {lines}")
