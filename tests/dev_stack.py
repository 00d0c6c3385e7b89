"""Drive `roundtable dev --demo` as a person would: start it, read what it
prints, stop it with Ctrl-C."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from roundtable.ports import free_port

CLI = str(Path(sys.executable).parent / "roundtable")


def run_cli(
    *args: str, cwd: Path, env: dict[str, str], timeout: float = 60
) -> subprocess.CompletedProcess:  # type: ignore[type-arg]
    """A `roundtable` command to its end, its output captured as text."""
    return subprocess.run(
        [CLI, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def run_printed(command: str, cwd: Path, env: dict[str, str]) -> dict:
    """A command the CLI printed for a person, run as printed (plus --json):
    its one JSON document. It must succeed."""
    done = subprocess.run(
        [*shlex.split(command), "--json"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, (command, done.stdout + done.stderr)
    return json.loads(done.stdout)


def listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


@dataclass
class DevStack:
    process: subprocess.Popen
    workdir: Path
    port: int
    ui_port: int
    api_port: int
    metrics_port: int
    env: dict[str, str]
    lines: list[str] = field(default_factory=list)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, pattern: str, count: int = 1, within: float = 90) -> list[str]:
        """The first ``count`` matches of ``pattern`` in what the stack printed."""
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            found = [m for line in list(self.lines) for m in re.findall(pattern, line)]
            if len(found) >= count:
                return found
            assert self.process.poll() is None, self.output
            time.sleep(0.2)
        raise AssertionError(f"no {pattern!r} in:\n{self.output}")


@contextmanager
def dev_stack(workdir: Path, **extra_env: str) -> Iterator[DevStack]:
    ports = free_port(), free_port(), free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if k != "ROUNDTABLE_ACTION_SECRET_KEY"}
    env["ROUNDTABLE_DEMO_TICKET_WRITE_DELAY_SECONDS"] = "0.2"
    env.update(extra_env)
    process = subprocess.Popen(
        [
            CLI,
            "dev",
            "--demo",
            "--temporal-port",
            str(ports[0]),
            "--ui-port",
            str(ports[1]),
            "--api-port",
            str(ports[2]),
            "--metrics-port",
            str(ports[3]),
        ],
        cwd=workdir,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    stack = DevStack(process, workdir, *ports, env=env)
    reader = threading.Thread(target=lambda: stack.lines.extend(iter(process.stdout.readline, "")))
    reader.start()
    try:
        yield stack
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(timeout=60)
        reader.join(timeout=10)
