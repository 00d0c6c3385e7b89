"""Tools from real MCP servers (built with the official SDK), over stdio and HTTP."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from roundtable.models import Decision
from roundtable.tools.mcp import (
    FENCING_META,
    IDEMPOTENCY_META,
    MCPConfigError,
    MCPServerSpec,
    load_config,
    register_mcp_tools,
)
from roundtable.tools.mcp_sessions import MCPSessions
from tests.api_server import free_port
from tests.fake_openai import fake_openai, message
from tests.workflow_harness import harness, script
from workflows.roundtable import RoundtableWorkflow

SERVER = str(Path(__file__).parent / "mcp_servers" / "records_server.py")


def stdio_spec(log: Path) -> MCPServerSpec:
    return MCPServerSpec(
        name="records", command=sys.executable, args=(SERVER,), env={"RECORDS_LOG": str(log)}
    )


def calls(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


async def test_two_model_seats_and_mcp_tools_through_approval(tmp_path, monkeypatch) -> None:
    """The issue's 'done when': OpenAI-compatible seats (local fake), tools from
    a real MCP server, a write approved by a person, executed once."""
    log = tmp_path / "records.log"

    def replies(body: dict, _n: int) -> dict:
        system = body["messages"][0]["content"]
        if system.startswith("You chair"):
            return message("Record r-7 is resolved.")
        if "You are seat-1" in system and not any(m["role"] == "tool" for m in body["messages"]):
            return message(
                "Resolving.",
                [("records__update_record", {"record_id": "r-7", "status": "resolved"})],
            )
        if "You are seat-2" in system and not any(m["role"] == "tool" for m in body["messages"]):
            return message("Checking.", [("records__lookup", {"record_id": "r-7"})])
        return message("Done.")

    async with fake_openai(replies) as fake, MCPSessions() as sessions, harness(tmp_path) as h:
        monkeypatch.setenv("OPENAI_BASE_URL", fake.base_url)
        monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
        names = await register_mcp_tools(h.registry, [stdio_spec(log)], sessions)
        assert set(names) == {"records__lookup", "records__update_record"}
        assert h.registry.get("records__lookup").side_effect == "read"

        handle = await h.start(task_text="resolve r-7", model="openai:m", mode="parallel")
        state = await h.wait_for(handle, lambda s: bool(s.pending_approvals), within=60)
        (approval_id,) = state.pending_approvals
        for _ in range(100):  # seat-2's read runs freely, in parallel
            if calls(log):
                break
            await asyncio.sleep(0.1)
        assert [c["tool"] for c in calls(log)] == ["lookup"]  # the write waits for a person
        await handle.execute_update(
            RoundtableWorkflow.decide_approval,
            Decision(approval_id=approval_id, decision="approved", decided_by="op"),
        )
        result = await handle.result()
        assert (result.status, result.final_answer) == ("completed", "Record r-7 is resolved.")

        (action,) = await h.store.list_actions(handle.id)
        writes = [c for c in calls(log) if c["tool"] == "update_record"]
        assert len(writes) == 1 and writes[0]["status"] == "resolved"
        assert writes[0]["meta"][IDEMPOTENCY_META] == action["idempotency_key"]
        assert writes[0]["meta"][FENCING_META] == action["fencing_token"]
        assert action["status"] == "succeeded"
        # No field is declared safe, so the result shows none of the argument
        # values it echoes, as the action's public arguments show none.
        assert action["result"] == {"record_id": "[redacted]", "status": "[redacted]"}


def start_http_server(log: Path, port: int) -> subprocess.Popen:
    """The records server over streamable HTTP, ready to answer."""
    server = subprocess.Popen(
        [sys.executable, SERVER, "http", str(port)],
        env={"RECORDS_LOG": str(log), "PATH": "/usr/bin:/bin"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while True:
        try:
            httpx.get(f"http://127.0.0.1:{port}/mcp", timeout=1)
            return server
        except httpx.TransportError:
            if time.monotonic() > deadline:
                server.kill()
                raise AssertionError("MCP HTTP server did not start") from None
            time.sleep(0.2)


async def test_mcp_over_streamable_http(tmp_path) -> None:
    log, port = tmp_path / "records.log", free_port()
    server = await asyncio.to_thread(start_http_server, log, port)
    try:
        spec = MCPServerSpec(name="records", url=f"http://127.0.0.1:{port}/mcp")
        async with MCPSessions() as sessions, harness(tmp_path) as h:
            await register_mcp_tools(h.registry, [spec], sessions)
            handle = await h.start(
                task_text="t",
                write_policy="auto_approve_up_to:R2",
                script=script(
                    (
                        "seat-1",
                        1,
                        [
                            {
                                "name": "records__update_record",
                                "args": {"record_id": "r-1", "status": "closed"},
                            }
                        ],
                    )
                ),
            )
            assert (await handle.result()).status == "completed"
            (action,) = await h.store.list_actions(handle.id)
            assert action["status"] == "succeeded"
            (write,) = calls(log)
            assert write["meta"][IDEMPOTENCY_META] == action["idempotency_key"]
    finally:
        server.terminate()
        server.wait(timeout=20)


async def test_a_server_that_dies_mid_call_leaves_unknown(tmp_path) -> None:
    log = tmp_path / "records.log"
    async with MCPSessions() as sessions, harness(tmp_path) as h:
        await register_mcp_tools(h.registry, [stdio_spec(log)], sessions)
        handle = await h.start(
            task_text="t",
            write_policy="auto_approve_up_to:R2",
            script=script(
                (
                    "seat-1",
                    1,
                    [
                        {
                            "name": "records__update_record",
                            "args": {"record_id": "crash", "status": "x"},
                        }
                    ],
                )
            ),
        )
        state = await h.wait_for(handle, lambda s: bool(s.unknown_actions), within=60)
        (action_id,) = state.unknown_actions
        action = await h.store.get_action(action_id)
        assert action["status"] == "unknown"
        assert [c["record_id"] for c in calls(log)] == ["crash"]  # reached, then died
        await asyncio.sleep(1)
        assert len(calls(log)) == 1  # never called again
        await handle.terminate()


def test_config_file_overrides_and_errors(tmp_path) -> None:
    good = tmp_path / "mcp.json"
    good.write_text(
        json.dumps(
            {
                "mcpServers": {
                    "records": {
                        "command": "python",
                        "args": ["server.py"],
                        "env": {"A": "1"},
                        "roundtable": {
                            "errors_are_definite": True,
                            "tools": {
                                "update_record": {
                                    "risk_level": "R1",
                                    "target_key_fields": ["record_id"],
                                }
                            },
                        },
                    },
                    "remote": {"url": "http://127.0.0.1:9/mcp"},
                }
            }
        )
    )
    records, remote = load_config(good)
    assert records.args == ("server.py",) and records.errors_are_definite
    assert records.overrides["update_record"]["risk_level"] == "R1"
    assert remote.url and remote.target() == "http://127.0.0.1:9/mcp"
    for bad in (
        {},
        {"mcpServers": {"x": {}}},
        {"mcpServers": {"x": {"command": "a", "url": "http://b"}}},
        {"mcpServers": {"a__b": {"command": "a"}}},
    ):
        path = tmp_path / "bad.json"
        path.write_text(json.dumps(bad))
        with pytest.raises(MCPConfigError):
            load_config(path)
    with pytest.raises(MCPConfigError):
        load_config(tmp_path / "missing.json")


async def test_overrides_shape_the_registered_tools(tmp_path) -> None:
    from roundtable.tools.registry import ToolRegistry

    spec = MCPServerSpec(
        name="records",
        command=sys.executable,
        args=(SERVER,),
        env={"RECORDS_LOG": str(tmp_path / "r.log")},
        overrides={
            "update_record": {
                "risk_level": "R1",
                "target_key_fields": ["record_id"],
                "safe_argument_fields": ["record_id"],
            }
        },
    )
    registry = ToolRegistry()
    async with MCPSessions() as sessions:
        await register_mcp_tools(registry, [spec], sessions)
    tool = registry.get("records__update_record")
    assert (tool.risk_level, tool.target_key_fields) == ("R1", ("record_id",))
    assert tool.target_key_namespace == "mcp:records"
    with pytest.raises(Exception, match="status"):
        tool.normalize({"record_id": "r"})


async def test_an_untrusted_read_only_hint_runs_a_read_at_most_once(tmp_path) -> None:
    """Once a server's readOnlyHint was taken at its word: its "reads" ran
    without approval and were retried, so a read that writes ran again."""
    log = tmp_path / "records.log"
    async with MCPSessions() as sessions, harness(tmp_path) as h:
        await register_mcp_tools(h.registry, [stdio_spec(log)], sessions)
        assert not h.registry.get("records__lookup").retry_safe
        lookup = {"name": "records__lookup", "args": {"record_id": "crash"}}
        handle = await h.start(task_text="t", script=script(("seat-1", 1, [lookup])))
        await handle.result()
        await asyncio.sleep(1)
        assert [c["tool"] for c in calls(log)] == ["lookup"]  # reached once, never again
        thread = (await h.state(handle)).threads["seat-1"]
        assert "tool_error" in repr(thread) or "not_retried" in repr(thread)


def test_a_trusted_server_reads_are_retried(tmp_path) -> None:
    config = tmp_path / "mcp.json"
    config.write_text(
        json.dumps(
            {
                "mcpServers": {
                    "records": {"command": "x", "roundtable": {"trusted_read_only": True}},
                    "other": {"command": "y"},
                }
            }
        )
    )
    trusted, untrusted = load_config(config)
    assert trusted.trusted_read_only and not untrusted.trusted_read_only
