"""The worker reads ROUNDTABLE_MCP_CONFIG at start and its tools work end to end."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from tests.e2e_stack import running_stack
from tests.workflow_harness import script

SERVER = str(Path(__file__).parent / "mcp_servers" / "records_server.py")


async def test_worker_loads_mcp_servers_from_the_config_file(tmp_path: Path) -> None:
    log = tmp_path / "records.log"
    config = tmp_path / "mcp.json"
    config.write_text(
        json.dumps(
            {
                "mcpServers": {
                    "records": {
                        "command": sys.executable,
                        "args": [SERVER],
                        "env": {"RECORDS_LOG": str(log)},
                    }
                }
            }
        )
    )
    run_script = tmp_path / "s.json"
    run_script.write_text(
        json.dumps(
            script(
                (
                    "seat-1",
                    1,
                    [
                        {"name": "records__lookup", "args": {"record_id": "r-9"}},
                        {
                            "name": "records__update_record",
                            "args": {"record_id": "r-9", "status": "done"},
                        },
                    ],
                )
            )
        )
    )
    async with running_stack(tmp_path, mcp_config=str(config)) as stack:
        started = await stack.start(
            "--task",
            "t",
            "--script",
            str(run_script),
            "--tools",
            "records__lookup,records__update_record",
        )
        run_id = started["run_id"]
        (approval,) = await stack.pending_approvals(run_id, "the MCP write's approval")
        assert approval["tool_name"] == "records__update_record"
        code, _ = await asyncio.to_thread(stack.cli, "approve", approval["id"])
        assert code == 0
        await asyncio.to_thread(
            stack.until, stack.run_with_status(run_id, "completed"), "completion"
        )
    seen = [json.loads(line)["tool"] for line in log.read_text().splitlines()]
    assert seen == ["lookup", "update_record"]
