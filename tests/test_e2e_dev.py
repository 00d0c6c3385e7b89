"""`make run` (roundtable dev --demo) as a person uses it: follow the printed
commands, watch the run finish, press Ctrl-C, and find nothing left running."""

from __future__ import annotations

import subprocess
from pathlib import Path

import httpx

from tests.dev_stack import CLI, dev_stack, listening


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
