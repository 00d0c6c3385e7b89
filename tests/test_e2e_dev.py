"""`make run` (roundtable dev --demo) as a person uses it: follow the printed
commands, watch the run finish, press Ctrl-C, and find nothing left running."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import httpx

from tests.dev_stack import CLI, dev_stack, free_port, listening


def test_dev_demo_runs_to_completion_and_stops_cleanly(tmp_path: Path) -> None:
    with dev_stack(tmp_path) as stack:
        stack.wait_for(rf"Temporal UI: http://127\.0\.0\.1:{stack.ui_port}/")
        (token,) = stack.wait_for(r"operator token \(shown once\): (rt_\S+)")
        runs = httpx.get(
            f"http://127.0.0.1:{stack.api_port}/v1/runs",
            headers={"Authorization": f"Bearer {token}"},
            timeout=10,
        )
        assert runs.status_code == 200, runs.text
        for command in stack.wait_for(r"approve: (.+ approve \S+)", count=2):
            variables, argv = command.split(" ", 1)
            name, value = variables.split("=", 1)
            done = subprocess.run(
                [CLI, *argv.split()[1:], "--json"],
                cwd=tmp_path,
                env={**stack.env, name: value},
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            assert done.returncode == 0, done.stdout + done.stderr
        stack.wait_for(r"run (demo-\S+) completed")
        assert (tmp_path / ".roundtable" / "dev-secret").stat().st_mode & 0o077 == 0
        assert listening(stack.port)
    assert "stack stopped" in stack.output
    ports = (stack.port, stack.ui_port, stack.api_port)
    assert not any(listening(p) for p in ports), "a server was left running"


def test_dev_says_why_the_worker_did_not_start(tmp_path: Path) -> None:
    """Once it exited 1 printing only "stack stopped"."""
    config = tmp_path / "mcp.json"
    config.write_text('{"mcpServers": {"crm": {"command": "no-such-mcp-server-binary"}}}')
    env = {k: v for k, v in os.environ.items() if k != "ROUNDTABLE_ACTION_SECRET_KEY"}
    env["ROUNDTABLE_MCP_CONFIG"] = str(config)
    ports = [str(free_port()) for _ in range(3)]
    done = subprocess.run(
        [CLI, "dev", "--temporal-port", ports[0], "--ui-port", ports[1], "--api-port", ports[2]],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 1
    said = done.stdout + done.stderr
    assert "the worker did not start" in said and "no-such-mcp-server-binary" in said, said
    assert "Traceback" not in said
    assert not listening(int(ports[0])), "the Temporal server was left running"
