"""The real embedded stack for end-to-end tests: a Temporal dev server
(``start_local``) and ``roundtable worker`` as its own process."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from temporalio.testing import WorkflowEnvironment

from roundtable.temporal import data_converter
from tests.conftest import TEST_SECRET
from tests.temporal_servers import start_dev_server
from tests.workflow_harness import script, ticket_call
from workflows import search_attributes

CLI = str(Path(sys.executable).parent / "roundtable")


class Stack:
    def __init__(self, env: WorkflowEnvironment, workdir: Path, address: str) -> None:
        self.env, self.workdir, self.address = env, workdir, address
        self.workers: list[subprocess.Popen] = []  # type: ignore[type-arg]
        self.vars = {
            **os.environ,
            "ROUNDTABLE_DATABASE_URL": f"sqlite+aiosqlite:///{workdir / 'rt.db'}",
            "ROUNDTABLE_TEMPORAL_ADDRESS": address,
            "ROUNDTABLE_TASK_QUEUE": f"e2e-{uuid.uuid4().hex[:8]}",
            # Workers here come and go: none serves metrics.
            "ROUNDTABLE_WORKER_METRICS_ADDRESS": "",
            "ROUNDTABLE_ACTION_SECRET_KEY": TEST_SECRET,
            "ROUNDTABLE_DEMO_TICKET_WRITE_DELAY_SECONDS": "0.1",
            "ROUNDTABLE_DEMO_TICKET_DROP_AFTER_WRITE": '["T-13"]',
            "ROUNDTABLE_SWEEP_INTERVAL_SECONDS": "3600",
            # These tests write unattended (auto-approved up to R3) from the CLI.
            "ROUNDTABLE_POLICY_CEILING_OPERATOR": "auto_approve_up_to:R3",
        }

    def cli(self, *args: str, env: dict[str, str] | None = None) -> tuple[int, Any]:
        done = subprocess.run(
            [CLI, *args, "--json"],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            env={**self.vars, **(env or {})},
            cwd=self.workdir,
        )
        lines = done.stdout.strip().splitlines()
        assert len(lines) == 1, f"expected one JSON document, got {done.stdout!r} {done.stderr}"
        return done.returncode, json.loads(lines[0])

    def until(self, probe, what: str, within: float = 60):  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            value = probe()
            if value:
                return value
            time.sleep(0.3)
        raise AssertionError(f"timed out waiting for {what}")

    async def start(self, *args: str) -> dict[str, Any]:
        """``roundtable start`` with these options; it must succeed."""
        code, started = await asyncio.to_thread(self.cli, "start", *args)
        assert code == 0, started
        return started

    async def pending_approvals(self, run_id: str, what: str = "a pending approval") -> list:
        return await asyncio.to_thread(
            self.until,
            lambda: self.cli("approvals", "--run", run_id, "--status", "pending")[1],
            what,
        )

    def run_with_status(self, run_id: str, wanted: str):  # type: ignore[no-untyped-def]
        """A probe for until(): the run's view once it has ``wanted`` status."""
        return lambda: (lambda v: v if v["status"] == wanted else None)(self.cli("show", run_id)[1])

    def start_worker(self) -> subprocess.Popen:  # type: ignore[type-arg]
        log = (self.workdir / "worker.log").open("a")
        worker = subprocess.Popen(
            [CLI, "worker"], env=self.vars, cwd=self.workdir, stdout=log, stderr=subprocess.STDOUT
        )
        log.close()
        self.workers.append(worker)
        return worker

    def kill_worker(self, worker: subprocess.Popen) -> None:  # type: ignore[type-arg]
        """A crash, not a shutdown: no cleanup code runs in the worker."""
        worker.send_signal(signal.SIGKILL)
        worker.wait(timeout=20)

    def stop_workers(self) -> list[int]:
        codes = []
        for worker in self.workers:
            if worker.poll() is None:
                worker.terminate()
                try:
                    worker.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    worker.kill()
                    worker.wait(timeout=5)
                codes.append(worker.returncode)
        return codes


@asynccontextmanager
async def running_stack(
    workdir: Path, server_args: list[str] | None = None, **settings: str
) -> AsyncIterator[Stack]:
    """``settings`` are extra ROUNDTABLE_* variables for the worker and the CLI."""
    env = await start_dev_server(
        search_attributes=list(search_attributes.ALL),
        data_converter=data_converter(),
        dev_server_extra_args=server_args or [],
    )
    stack = Stack(env, workdir, env.client.service_client.config.target_host)
    stack.vars.update({f"ROUNDTABLE_{k.upper()}": v for k, v in settings.items()})
    # As a deployment does: the schema first, then the processes that use it.
    code, upgraded = await asyncio.to_thread(stack.cli, "db", "upgrade")
    assert code == 0, upgraded
    stack.start_worker()
    try:
        yield stack
    finally:
        codes = stack.stop_workers()
        await env.shutdown()
    assert all(code == 0 for code in codes), (workdir / "worker.log").read_text()[-2000:]


def one_write_script(path: Path, ticket: str = "T-1") -> str:
    """A scripted run whose one seat updates one ticket; returns the file's path."""
    path.write_text(
        json.dumps(script(("seat-1", 1, [ticket_call("ticket_update", ticket)]), final="all done"))
    )
    return str(path)
