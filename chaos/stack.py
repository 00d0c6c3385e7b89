"""The processes under test: a Temporal dev server, workers and the API, each
its own process with its own log file, all tied to the harness's life.

Every child gets PR_SET_PDEATHSIG (SIGKILL when the harness dies, however it
dies) and is also killed by its pid on exit; the dev server runs in its own
session, so it is stopped through its process group."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from roundtable.names import SEARCH_ATTRIBUTES
from roundtable.ports import free_port

BIN = Path(sys.executable).parent
SECRET = "chaos-action-secret-not-for-production"  # noqa: S105 (a throwaway test secret)
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL me when the harness goes away."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen  # type: ignore[type-arg]
    log: Path
    group: bool = False  # its own process group (the dev server)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if not self.alive():
            return
        with contextlib.suppress(ProcessLookupError):
            if self.group:
                os.killpg(self.pid, sig)
            else:
                os.kill(self.pid, sig)

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM, then SIGKILL after ``grace`` seconds; thawed first if frozen."""
        if not self.alive():
            return
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        try:
            self.popen.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            self.popen.wait(timeout=10)


@dataclass
class Stack:
    workdir: Path
    database_url: str
    webhook_url: str | None = None
    temporal_port: int = field(default_factory=free_port)
    api_port: int = field(default_factory=free_port)
    task_queue: str = "chaos"
    procs: list[Proc] = field(default_factory=list)
    temporal: Proc | None = None
    api: Proc | None = None
    workers: list[Proc] = field(default_factory=list)
    _count: int = 0

    def __post_init__(self) -> None:
        self.logs = self.workdir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.fault_file = self.workdir / "db-faults"
        self.fault_file.write_text("")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.temporal_port}"

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    @property
    def temporal_db(self) -> Path:
        return self.workdir / "temporal.db"

    def env(self, **extra: str) -> dict[str, str]:
        """What every process of the stack (and the CLI) runs with."""
        env = {
            **os.environ,
            "ROUNDTABLE_DATABASE_URL": self.database_url,
            "ROUNDTABLE_TEMPORAL_ADDRESS": self.address,
            "ROUNDTABLE_TASK_QUEUE": self.task_queue,
            # Several workers on one host: none serves metrics (not under test here).
            "ROUNDTABLE_WORKER_METRICS_ADDRESS": "",
            "ROUNDTABLE_ACTION_SECRET_KEY": SECRET,
            "ROUNDTABLE_SWEEP_INTERVAL_SECONDS": "5",
            "ROUNDTABLE_DEMO_TICKET_WRITE_DELAY_SECONDS": "0.3",
            "ROUNDTABLE_POLICY_CEILING_OPERATOR": "auto_approve_up_to:R3",
            "ROUNDTABLE_POLICY_CEILING_SERVICE": "auto_approve_up_to:R3",
            "ROUNDTABLE_POLICY_CEILING_USER": "auto_approve_up_to:R3",
            "ROUNDTABLE_OPERATOR_APPROVAL_RISK": "none",
            "ROUNDTABLE_APPROVAL_EXPIRING_LEAD_SECONDS": "3",
            # The test-only fault hook (roundtable/chaos_hook.py), armed by
            # writing to this file; empty means disarmed.
            "ROUNDTABLE_CHAOS": "1",
            "ROUNDTABLE_CHAOS_DB_FAULTS_FILE": str(self.fault_file),
        }
        if self.webhook_url:
            env["ROUNDTABLE_WEBHOOK_URLS"] = json.dumps([self.webhook_url])
        return {**env, **extra}

    def _spawn(self, name: str, command: list[str], env: dict[str, str], group: bool) -> Proc:
        self._count += 1
        log = self.logs / f"{name}-{self._count}.log"
        with log.open("ab") as out:
            popen = subprocess.Popen(  # noqa: S603 - our own binaries, fixed arguments
                command,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=self.workdir,
                start_new_session=group,
                preexec_fn=_die_with_parent,
            )
        proc = Proc(name, popen, log, group)
        self.procs.append(proc)
        return proc

    # ----------------------------------------------------------------- temporal

    def start_temporal(self) -> Proc:
        command = [
            str(BIN / "temporal"),
            "server",
            "start-dev",
            "--headless",
            "--ip",
            "127.0.0.1",
            "--port",
            str(self.temporal_port),
            "--db-filename",
            str(self.temporal_db),
            "--log-level",
            "warn",
        ]
        for name, kind in SEARCH_ATTRIBUTES.items():
            command += ["--search-attribute", f"{name}={kind}"]
        self.temporal = self._spawn("temporal", command, self.env(), group=True)
        self._wait_port(self.temporal_port, self.temporal, 60)
        return self.temporal

    def stop_temporal(self) -> None:
        if self.temporal is not None:
            self.temporal.stop()

    # ----------------------------------------------------------------- workers and API

    def start_worker(self, *options: str, **extra: str) -> Proc:
        """``roundtable worker OPTIONS`` (say ``--role tools``), ``extra``
        added to its environment."""
        worker = self._spawn(
            "worker", [str(BIN / "roundtable"), "worker", *options], self.env(**extra), False
        )
        self.workers.append(worker)
        return worker

    def live_workers(self) -> list[Proc]:
        self.workers = [w for w in self.workers if w.alive()]
        return list(self.workers)

    def start_api(self) -> Proc:
        command = [str(BIN / "roundtable"), "api", "--port", str(self.api_port)]
        self.api = self._spawn("api", command, self.env(), False)
        self._wait_port(self.api_port, self.api, 60)
        return self.api

    def cli(self, *args: str, timeout: float = 60) -> tuple[int, object]:
        """``roundtable ARGS --json``: the exit code and the one JSON document."""
        done = subprocess.run(  # noqa: S603
            [str(BIN / "roundtable"), *args, "--json"],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            env=self.env(),
            cwd=self.workdir,
        )
        with (self.logs / "cli.log").open("a") as log:
            log.write(f"$ roundtable {args[0]} → {done.returncode}\n{done.stderr}")
        try:
            return done.returncode, json.loads(done.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            return done.returncode, {"error": {"message": done.stderr[-500:]}}

    @staticmethod
    def _wait_port(port: int, proc: Proc, within: float) -> None:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            if not proc.alive():
                raise RuntimeError(f"{proc.name} exited ({proc.popen.returncode}); see {proc.log}")
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", port)) == 0:
                    return
            time.sleep(0.2)
        raise RuntimeError(f"{proc.name} did not listen on {port}; see {proc.log}")

    def close(self) -> None:
        """End every process this harness started, by its pid (or group)."""
        for proc in reversed(self.procs):
            with contextlib.suppress(Exception):
                proc.stop(grace=10)

    def log_files(self) -> list[Path]:
        return sorted(self.logs.glob("*.log"))


def wait_until(probe: Callable[[], bool], within: float, step: float = 0.5) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if probe():
            return True
        time.sleep(step)
    return False
