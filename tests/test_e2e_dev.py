"""`make run` (roundtable dev --demo) as a person uses it: follow the printed
commands, watch the run finish, press Ctrl-C, and find nothing left running."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

CLI = str(Path(sys.executable).parent / "roundtable")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_dev_demo_runs_to_completion_and_stops_cleanly(tmp_path: Path) -> None:
    port, ui_port, api_port = free_port(), free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if k != "ROUNDTABLE_ACTION_SECRET_KEY"}
    env["ROUNDTABLE_DEMO_TICKET_WRITE_DELAY_SECONDS"] = "0.2"
    stack = subprocess.Popen(
        [
            CLI,
            "dev",
            "--demo",
            "--temporal-port",
            str(port),
            "--ui-port",
            str(ui_port),
            "--api-port",
            str(api_port),
        ],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(stack.stdout.readline, "")))
    reader.start()

    def wait_for(pattern: str, count: int = 1, within: float = 90) -> list[str]:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            found = [m for line in list(lines) for m in re.findall(pattern, line)]
            if len(found) >= count:
                return found
            assert stack.poll() is None, "".join(lines)
            time.sleep(0.2)
        raise AssertionError(f"no {pattern!r} in:\n{''.join(lines)}")

    try:
        wait_for(rf"Temporal UI: http://127\.0\.0\.1:{ui_port}/")
        (token,) = wait_for(r"operator token \(shown once\): (rt_\S+)")
        runs = httpx.get(
            f"http://127.0.0.1:{api_port}/v1/runs",
            headers={"Authorization": f"Bearer {token}"},
            timeout=10,
        )
        assert runs.status_code == 200, runs.text
        commands = wait_for(r"approve: (.+ approve \S+)", count=2)
        for command in commands:
            variables, argv = command.split(" ", 1)
            name, value = variables.split("=", 1)
            done = subprocess.run(
                [CLI, *argv.split()[1:], "--json"],
                cwd=tmp_path,
                env={**env, name: value},
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            assert done.returncode == 0, done.stdout + done.stderr
        wait_for(r"run (demo-\S+) completed")
        assert (tmp_path / ".roundtable" / "dev-secret").stat().st_mode & 0o077 == 0
        assert listening(port)
    finally:
        stack.send_signal(signal.SIGINT)
        stack.wait(timeout=60)
        reader.join(timeout=10)
    assert "stack stopped" in "".join(lines)
    assert not any(listening(p) for p in (port, ui_port, api_port)), "a server was left running"
