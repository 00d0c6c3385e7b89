"""Run what our documentation tells a person to run, as written: the code
blocks of a Markdown page, a stack started by one of them, and the commands
the stack and `start --wait` print for the person to run next."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from roundtable.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
# The environment running these tests (a worktree may have none of its own).
VENV = Path(sys.executable).parent.parent
# What a person would have to fill in before a block runs.
PLACEHOLDERS = ("…", "...")


@dataclass(frozen=True)
class Block:
    language: str
    code: str
    line: int  # where the block starts in its page

    @property
    def first_line(self) -> str:
        return self.code.strip().splitlines()[0]


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    return [
        Block(m.group(1), m.group(2), text.count("\n", 0, m.start()) + 1)
        for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE)
    ]


def placeholders(block: Block) -> list[str]:
    return [hole for hole in PLACEHOLDERS if hole in block.code]


def checkout_shape(directory: Path) -> None:
    """``directory`` looks like the repository's top to commands written for
    it (``.venv/bin/roundtable``, ``examples/…``), with state of its own."""
    (directory / ".venv").symlink_to(VENV)
    (directory / "examples").symlink_to(ROOT / "examples")


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without Roundtable's variables: a person's shell."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROUNDTABLE_")}
    return {**env, **extra}


def sh(command: str, cwd: Path, env: dict[str, str], timeout: float = 60) -> str:
    done = subprocess.run(  # noqa: S602 (our documentation's own commands)
        command,
        shell=True,
        cwd=cwd,
        env=env,
        text=True,
        capture_output=True,
        timeout=timeout,
        check=False,
        executable="/bin/bash",
    )
    assert done.returncode == 0, (command, done.stdout, done.stderr)
    return done.stdout


def shell(command: str, cwd: Path, env: dict[str, str], **options: Any) -> subprocess.Popen:  # type: ignore[type-arg]
    """``command`` in bash, its output (both streams) read as text lines."""
    return subprocess.Popen(  # noqa: S602 (our documentation's own commands)
        command,
        shell=True,
        cwd=cwd,
        env=env,
        text=True,
        executable="/bin/bash",
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        **options,
    )


@dataclass
class Stack:
    """A `roundtable dev` started by a documented command, on ports of its own."""

    ports: dict[str, int]
    lines: list[str] = field(default_factory=list)

    @property
    def cli_env(self) -> dict[str, str]:
        return clean_env(ROUNDTABLE_TEMPORAL_ADDRESS=f"127.0.0.1:{self.ports['temporal']}")

    def wait_for(self, pattern: str, process: subprocess.Popen, within: float = 120) -> None:  # type: ignore[type-arg]
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            if any(re.search(pattern, line) for line in list(self.lines)):
                return
            assert process.poll() is None, "".join(self.lines)
            time.sleep(0.2)
        raise AssertionError(f"no {pattern!r} in:\n{''.join(self.lines)}")


@contextmanager
def documented_stack(command: str, cwd: Path, env: dict[str, str]) -> Iterator[Stack]:
    """Run ``command`` (one that ends in `roundtable dev`) with port flags
    added, until it serves its API; stop it with Ctrl-C at the end."""
    stack = Stack({name: free_port() for name in ("temporal", "ui", "api", "metrics")})
    flags = " ".join(f"--{name}-port {port}" for name, port in stack.ports.items())
    process = shell(command.strip() + " " + flags, cwd, env, start_new_session=True)
    reader = threading.Thread(target=lambda: stack.lines.extend(iter(process.stdout.readline, "")))
    reader.start()
    try:
        stack.wait_for(rf"API: http://127\.0\.0\.1:{stack.ports['api']}/docs", process)
        yield stack
    finally:
        with contextlib.suppress(ProcessLookupError):  # it may have died on its own
            os.killpg(process.pid, signal.SIGINT)
        process.wait(timeout=60)
        reader.join(timeout=10)
    assert "stack stopped" in "".join(stack.lines)


class Waiting:
    """A `start --wait` command to its end: each approval it prints is
    approved with the command it printed; each unknown outcome reconciled
    with the printed command, its outcome and note replaced by ``settle``."""

    def __init__(self, command: str, cwd: Path, env: dict[str, str], settle: str = "") -> None:
        self.lines: list[str] = []
        self.process = shell(command, cwd, env)
        self.cwd, self.env, self.settle = cwd, env, settle
        self.reader = threading.Thread(
            target=lambda: self.lines.extend(iter(self.process.stdout.readline, ""))
        )
        self.reader.start()

    def act(self, within: float = 120) -> str:
        deadline, seen = time.monotonic() + within, 0
        while time.monotonic() < deadline:
            for line in self.lines[seen:]:
                seen += 1
                found = re.match(r"\s+(approve|reconcile): (.+)$", line)
                if found is None:
                    continue
                command = found.group(2)
                if found.group(1) == "reconcile":
                    assert self.settle, f"nothing says how to settle: {line}"
                    command = re.sub(r"--outcome \S+ --note \S+", self.settle, command)
                sh(command, self.cwd, self.env)
            if self.process.poll() is not None and seen >= len(self.lines):
                self.reader.join(timeout=10)
                assert self.process.returncode == 0, "".join(self.lines)
                return "".join(self.lines)
            time.sleep(0.2)
        self.process.kill()
        raise AssertionError("".join(self.lines))
