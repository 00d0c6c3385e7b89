"""One long-lived session per stdio MCP server (issue 13, part 6), through a
real server process that the tests kill by PID: between calls (the next call
restarts the session and runs once) and mid-call (the write stays `unknown`
and is never sent again)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from roundtable.config import Settings
from roundtable.tools.mcp import IDEMPOTENCY_META, MCPServerSpec, register_mcp_tools
from roundtable.tools.mcp_sessions import MCPSessions, MCPUnavailable
from roundtable.tools.registry import ToolContext, ToolDefiniteFailure, ToolRegistry
from tests.processes import running
from tests.workflow_harness import harness, script
from worker import worker_parts

SERVER = str(Path(__file__).parent / "mcp_servers" / "lifecycle_server.py")
NAME = "life"


@dataclass
class Lifecycle:
    """The server's own record of its processes and of the calls it saw."""

    log: Path
    starts: Path

    @classmethod
    def at(cls, tmp_path: Path) -> Lifecycle:
        return cls(tmp_path / "calls.log", tmp_path / "starts.log")

    def env(self) -> dict[str, str]:
        return {"LIFECYCLE_LOG": str(self.log), "LIFECYCLE_STARTS": str(self.starts)}

    def spec(self) -> MCPServerSpec:
        # Per-key targets: an unknown write blocks its own key, not the server.
        return MCPServerSpec(
            name=NAME,
            command=sys.executable,
            args=(SERVER,),
            env=self.env(),
            overrides={"set_value": {"target_key_fields": ["key"]}},
        )

    def pids(self) -> list[int]:
        """One PID per server process started, in order."""
        return [int(p) for p in self.starts.read_text().split()] if self.starts.exists() else []

    def calls(self, tool: str | None = None, key: str | None = None) -> list[dict[str, Any]]:
        lines = self.log.read_text().splitlines() if self.log.exists() else []
        seen = [json.loads(line) for line in lines]
        return [
            c
            for c in seen
            if (tool is None or c["tool"] == tool) and (key is None or c.get("key") == key)
        ]


async def until(check: Callable[[], bool], what: str, within: float = 30) -> None:
    """A bound for something that must happen, not a timing under test."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while not check():
        if loop.time() > deadline:
            raise AssertionError(f"never happened: {what}")
        await asyncio.sleep(0.02)


def set_value(key: str, value: str = "v") -> dict[str, Any]:
    return {"name": f"{NAME}__set_value", "args": {"key": key, "value": value}}


def get_value(key: str) -> dict[str, Any]:
    return {"name": f"{NAME}__get_value", "args": {"key": key}}


async def run_calls(h: Any, *calls: dict[str, Any]) -> Any:
    handle = await h.start(
        task_text="t",
        write_policy="auto_approve_up_to:R2",
        script=script(("seat-1", 1, list(calls))),
    )
    # Not time-skipping: a run of the test waiting for ever (on an unknown
    # write) would be skipped to its 10-year execution timeout and closed.
    with h.env.auto_time_skipping_disabled():
        assert (await handle.result()).status == "completed"
    return handle


async def test_calls_reuse_one_server_process(tmp_path: Path) -> None:
    """The issue itself: calls no longer start a server process each."""
    life = Lifecycle.at(tmp_path)
    async with MCPSessions() as sessions, harness(tmp_path) as h:
        await register_mcp_tools(h.registry, [life.spec()], sessions)
        first = await run_calls(h, set_value("a"), get_value("a"), set_value("b"))
        second = await run_calls(h, set_value("c"))
        actions = [*await h.store.list_actions(first.id), *await h.store.list_actions(second.id)]
        assert [a["status"] for a in actions] == ["succeeded"] * 3

    (pid,) = life.pids()  # discovery and all four calls: one process
    assert [c["pid"] for c in life.calls()] == [pid] * 4
    assert not running(pid)  # and it is gone once the sessions are closed


async def test_concurrent_calls_share_one_session(tmp_path: Path) -> None:
    """Three calls at once over one session: each returns only when all three
    are inside the server together, so they were served side by side."""
    life = Lifecycle.at(tmp_path)
    registry = ToolRegistry()
    async with MCPSessions() as sessions:
        await register_mcp_tools(registry, [life.spec()], sessions)
        meet = registry.get(f"{NAME}__meet")
        context = ToolContext(run_id="r", seat="seat-1")
        async with asyncio.timeout(60):  # a bound: apart, the calls would wait for ever
            results = await asyncio.gather(*(meet.handler({"n": 3}, context) for _ in range(3)))
    (pid,) = life.pids()
    assert results == [{"met": 3, "pid": pid}] * 3


async def test_a_cancelled_call_leaves_the_session_to_the_others(tmp_path: Path) -> None:
    """A lost lease cancels its call in the activity's task: the session,
    owned by a task of its own, goes on serving the calls after it."""
    life = Lifecycle.at(tmp_path)
    registry = ToolRegistry()
    async with MCPSessions() as sessions:
        await register_mcp_tools(registry, [life.spec()], sessions)
        context = ToolContext(run_id="r", seat="seat-1", idempotency_key="k", fencing_token=1)
        write = registry.get(f"{NAME}__set_value")
        blocked = asyncio.create_task(write.handler({"key": "block", "value": "v"}, context))
        await until(lambda: bool(life.calls("set_value", "block")), "the write reached the server")
        blocked.cancel()
        with pytest.raises(asyncio.CancelledError):
            await blocked
        assert sessions.is_open(NAME)
        after = await write.handler({"key": "after", "value": "v"}, context)
    (pid,) = life.pids()
    assert after == {"key": "after", "value": "v", "pid": pid}
    assert len(life.calls("set_value", "block")) == 1


async def test_a_server_killed_between_calls_is_restarted_and_the_write_runs_once(
    tmp_path: Path,
) -> None:
    life = Lifecycle.at(tmp_path)
    async with MCPSessions() as sessions, harness(tmp_path) as h:
        await register_mcp_tools(h.registry, [life.spec()], sessions)
        await run_calls(h, set_value("before"))
        (old,) = life.pids()

        os.kill(old, signal.SIGKILL)
        await until(lambda: not sessions.is_open(NAME), "the session noticed its server died")
        assert life.pids() == [old]  # restarted when needed, not eagerly

        handle = await run_calls(h, get_value("after"), set_value("after"))
        (action,) = await h.store.list_actions(handle.id)  # the write; reads are no actions
        assert action["status"] == "succeeded"

    old_again, new = life.pids()  # exactly one new process
    assert old_again == old and new != old
    (write,) = life.calls("set_value", "after")  # the write ran exactly once,
    assert write["pid"] == new  # on the new process
    assert write["meta"][IDEMPOTENCY_META] == action["idempotency_key"]
    (read,) = life.calls("get_value", "after")  # an untrusted read: once too
    assert read["pid"] == new


async def test_a_server_killed_mid_call_leaves_unknown_and_nothing_is_resent(
    tmp_path: Path,
) -> None:
    life = Lifecycle.at(tmp_path)
    async with MCPSessions() as sessions, harness(tmp_path) as h:
        await register_mcp_tools(h.registry, [life.spec()], sessions)
        blocked = await h.start(
            task_text="t",
            write_policy="auto_approve_up_to:R2",
            script=script(("seat-1", 1, [set_value("block")])),
        )
        await until(lambda: bool(life.calls("set_value", "block")), "the write reached the server")
        (old,) = life.pids()

        os.kill(old, signal.SIGKILL)  # while the call waits for its answer
        state = await h.wait_for(blocked, lambda s: bool(s.unknown_actions), within=60)
        (action_id,) = state.unknown_actions
        action = await h.store.get_action(action_id)
        assert action["status"] == "unknown"
        assert action["result"]["error_code"] == "tool_error"

        # Later calls work, on a restarted session.
        after = await run_calls(h, set_value("after"))
        (done,) = await h.store.list_actions(after.id)
        assert done["status"] == "succeeded"
        await blocked.terminate()

    old_again, new = life.pids()
    assert old_again == old and new != old
    assert len(life.calls("set_value", "block")) == 1  # sent once, never again
    assert [c["pid"] for c in life.calls("set_value", "after")] == [new]


async def test_worker_shutdown_leaves_no_server_process(tmp_path: Path) -> None:
    """The worker's parts own the sessions: their servers end with them."""
    life = Lifecycle.at(tmp_path)
    config = tmp_path / "mcp.json"
    config.write_text(
        json.dumps(
            {"mcpServers": {NAME: {"command": sys.executable, "args": [SERVER], "env": life.env()}}}
        )
    )
    settings = Settings(
        database_url=f"sqlite+aiosqlite:///{tmp_path / 'rt.db'}", mcp_config=str(config)
    )
    async with worker_parts(settings) as parts:
        get = parts.registry.get(f"{NAME}__get_value")
        answer = await get.handler({"key": "k"}, ToolContext(run_id="r", seat="seat-1"))
        (pid,) = life.pids()
        assert answer["pid"] == pid and running(pid)  # kept open between calls
    assert not running(pid)


async def test_a_server_that_cannot_start_is_a_definite_failure(tmp_path: Path) -> None:
    """Nothing was sent, so nothing can have happened: not an unknown."""
    broken = MCPServerSpec(
        name="broken", command=sys.executable, args=("-c", "raise SystemExit(3)")
    )
    async with MCPSessions() as sessions:
        for _ in range(2):  # each call tries a fresh start; none is left behind
            with pytest.raises(MCPUnavailable) as raised:
                await sessions.call_tool(broken.name, broken.target(), "anything", {}, meta=None)
            assert isinstance(raised.value, ToolDefiniteFailure)
            assert raised.value.code == "mcp_unavailable"
            assert not sessions.is_open(broken.name)


async def test_a_server_gets_none_of_the_workers_secrets(tmp_path: Path, monkeypatch) -> None:
    """A tool server is another party: it gets the SDK's safe minimum and
    what its config gives, never the worker's environment."""
    monkeypatch.setenv("ROUNDTABLE_ACTION_SECRET_KEY", "worker-secret-" + "x" * 24)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-worker-only")
    life = Lifecycle.at(tmp_path)
    seen = tmp_path / "env.json"
    spec = life.spec()
    spec = MCPServerSpec(
        name=spec.name,
        command=spec.command,
        args=spec.args,
        env={**spec.env, "LIFECYCLE_ENV": str(seen)},
        overrides=spec.overrides,
    )
    async with MCPSessions() as sessions:
        await sessions.call_tool(NAME, spec.target(), "get_value", {"key": "k"}, meta=None)
    names = set(json.loads(seen.read_text()))
    assert {"LIFECYCLE_LOG", "LIFECYCLE_ENV", "PATH"} <= names
    assert not {n for n in names if n.startswith("ROUNDTABLE_") or n == "OPENAI_API_KEY"}


async def test_a_killed_worker_takes_its_server_with_it(tmp_path: Path) -> None:
    """SIGKILL runs no cleanup: the kernel's parent-death signal ends the
    kept server (it would otherwise run on, holding whatever it holds)."""
    from tests.e2e_stack import running_stack

    life = Lifecycle.at(tmp_path)
    config = tmp_path / "mcp.json"
    # One that outlives its input closing: only a signal ends it.
    entry = {
        "command": sys.executable,
        "args": [SERVER],
        "env": {**life.env(), "LIFECYCLE_LINGER": "1"},
    }
    config.write_text(json.dumps({"mcpServers": {NAME: entry}}))
    async with running_stack(tmp_path, mcp_config=str(config)) as stack:
        await until(lambda: bool(life.pids()), "the worker started its MCP server")
        (pid,) = life.pids()
        assert running(pid)
        (worker,) = stack.workers
        await asyncio.to_thread(stack.kill_worker, worker)
        await until(lambda: not running(pid), "the server died with its worker")
