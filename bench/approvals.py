"""The approval round trip and the history one approved write costs,
Roundtable against bare Temporal (bench/bare.py) on one dev server.

    .venv/bin/python -m bench.approvals [--approvals N] [--json FILE]

Each side has its own worker process. Bare and ours alternate, one approval
each in turn, so the machine's noise falls on both. Timed from the decision
call to (a) the decision call returning, (b) the write committed (the row's
own timestamp; ours: the action's ``finished_at``), (c) the workflow's
result. Printed as p50/p95 and the ratio ours / bare; compare ratios, not
absolute numbers (machines here are noisy).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from temporalio.client import Client
from temporalio.testing import WorkflowEnvironment

from bench import bare
from roundtable import operations
from roundtable.config import SECRET_ENV_VAR
from roundtable.models import RunInput, WorkflowArgs
from roundtable.names import RUN_WORKFLOW
from roundtable.permissions import Decider
from roundtable.store import open_store
from roundtable.temporal import connect, data_converter
from workflows import search_attributes

BIN = Path(sys.executable).parent
OURS, BARE = "bench-roundtable", "bench-bare"
ONE_WRITE = {
    "turns": [
        {
            "seat": "seat-1",
            "round": 1,
            "text": "updating",
            "tool_calls": [
                {
                    "name": "ticket_update",
                    "args": {"tenant_id": "acme", "ticket_id": "T-1", "fields": {"p": "high"}},
                }
            ],
        }
    ],
    "final": "done",
}
NO_WRITE = {"turns": [{"seat": "seat-1", "round": 1, "text": "nothing to do"}], "final": "done"}


class Bench:
    def __init__(self, workdir: Path, address: str) -> None:
        self.workdir, self.address = workdir, address
        self.db_file = workdir / "roundtable.db"
        self.url = f"sqlite+aiosqlite:///{self.db_file}"
        self.bare_db = str(workdir / "bare.db")
        # Workers may cache bytecode, as an installed package has it (pip
        # compiles at install): otherwise the sandbox compiles the workflow
        # modules from source again for every run it starts.
        inherited = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        self.env = {
            **inherited,
            "ROUNDTABLE_DATABASE_URL": self.url,
            "ROUNDTABLE_TEMPORAL_ADDRESS": address,
            "ROUNDTABLE_TASK_QUEUE": OURS,
            "ROUNDTABLE_DEMO_TICKET_WRITE_DELAY_SECONDS": "0",
            "ROUNDTABLE_SWEEP_ENABLED": "false",
        }
        self.workers: list[subprocess.Popen] = []  # type: ignore[type-arg]

    def start_workers(self) -> None:
        """The schema, then one worker process a side (our own commands)."""
        roundtable = str(BIN / "roundtable")
        upgrade = [roundtable, "db", "upgrade"]
        subprocess.run(upgrade, env=self.env, check=True, capture_output=True)  # noqa: S603
        bare_worker = [sys.executable, "-m", "bench.bare", "--address", self.address]
        bare_worker += ["--queue", BARE, "--db", self.bare_db]
        log = (self.workdir / "workers.log").open("a")
        for command in ([roundtable, "worker"], bare_worker):
            worker = subprocess.Popen(command, env=self.env, stdout=log, stderr=subprocess.STDOUT)  # noqa: S603
            self.workers.append(worker)

    def stop_workers(self) -> None:
        for worker in self.workers:
            worker.terminate()
        for worker in self.workers:
            try:
                worker.wait(timeout=30)
            except subprocess.TimeoutExpired:
                worker.kill()

    async def bare_once(self, client: Client) -> dict[str, float]:
        key = f"bare-{uuid.uuid4().hex[:12]}"
        handle = await client.start_workflow(bare.WORKFLOW, key, id=key, task_queue=BARE)
        await _waiting(handle)  # as ours is when decided: idle, waiting for the update
        t0 = time.time()
        await handle.execute_update(bare.DECIDE, "approved", result_type=str)
        returned = time.time()
        await handle.result()
        done = time.time()
        written = bare.written_at(self.bare_db, key)
        assert written is not None, "the bare write was not recorded"
        return {"update": returned - t0, "write": written - t0, "result": done - t0}

    async def ours_once(self, client: Client, store: Any) -> dict[str, float]:
        handle = await _start_ours(client, ONE_WRITE)
        approval = await _pending_approval(store, handle.id)
        action = await store.get_action(approval["action_id"])
        t0 = time.time()
        await _approve(client, store, approval, action["arguments_digest"])
        returned = time.time()
        await handle.result()
        done = time.time()
        finished = (await store.get_action(action["id"]))["finished_at"]
        return {"update": returned - t0, "write": finished.timestamp() - t0, "result": done - t0}

    async def history_events(self, client: Client) -> dict[str, int]:
        """Events one approved write adds to a run: a run with one write,
        decided, against the same run with none."""
        counts = {}
        async with open_store(self.url, migrate=False) as store:
            for name, script in (("one", ONE_WRITE), ("none", NO_WRITE)):
                handle = await _start_ours(client, script)
                if script is ONE_WRITE:
                    await _approve(client, store, await _pending_approval(store, handle.id))
                await handle.result()
                counts[name] = len((await handle.fetch_history()).events)
        bare_client = await Client.connect(self.address)
        key = f"bare-h-{uuid.uuid4().hex[:8]}"
        handle = await bare_client.start_workflow(bare.WORKFLOW, key, id=key, task_queue=BARE)
        await handle.execute_update(bare.DECIDE, "approved", result_type=str)
        await handle.result()
        return {
            "ours_per_approved_write": counts["one"] - counts["none"],
            "ours_run_with_one_write": counts["one"],
            "bare_workflow": len((await handle.fetch_history()).events),
        }


async def _start_ours(client: Client, script: dict[str, Any]) -> Any:
    run_id = f"run-bench-{uuid.uuid4().hex[:12]}"
    request = RunInput(
        run_id=run_id, task_text="bench", seats=["seat-1"], max_rounds=1, script=script
    )
    return await client.start_workflow(
        RUN_WORKFLOW, WorkflowArgs(request=request), id=run_id, task_queue=OURS
    )


async def _approve(
    client: Client, store: Any, approval: dict[str, Any], digest: str | None = None
) -> None:
    """As the API decides: through operations.decide, attested as an operator."""
    await operations.decide(
        client,
        store,
        approval["id"],
        "approved",
        "bench-operator",
        arguments_digest=digest,
        decider=Decider(user_id="bench-operator", role="operator"),
    )


async def _waiting(handle: Any, within: float = 30) -> None:
    """Until the workflow's first task has completed: it is waiting."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        history = await handle.fetch_history()
        if any(e.HasField("workflow_task_completed_event_attributes") for e in history.events):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{handle.id} never started waiting")


async def _pending_approval(store: Any, run_id: str, within: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            pending = await store.list_approvals(run_id=run_id, status="pending")
        except Exception:  # the run row may not exist yet
            pending = []
        if pending:
            return pending[0]
        await asyncio.sleep(0.02)
    raise AssertionError(f"{run_id} never asked for approval")


def cpu_seconds(pid: int) -> float:
    """User plus system CPU a process has used so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _summary(samples: list[dict[str, float]], key: str) -> dict[str, float]:
    values = sorted(s[key] * 1000 for s in samples)
    p95 = values[min(len(values) - 1, round(0.95 * (len(values) - 1)))]
    return {"p50_ms": round(statistics.median(values), 1), "p95_ms": round(p95, 1)}


def _profile(pid: int, out: Path) -> subprocess.Popen:  # type: ignore[type-arg]
    """py-spy sampling a worker (collapsed stacks) until it is sent SIGINT."""
    command = [str(BIN / "py-spy"), "record", "--pid", str(pid), "--format", "raw"]
    command += ["--rate", "200", "--nonblocking", "--output", str(out)]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # noqa: S603


async def run(approvals: int, warmup: int = 3, profile: Path | None = None) -> dict[str, Any]:
    os.environ.setdefault(SECRET_ENV_VAR, "bench-" + uuid.uuid4().hex)
    workdir = Path(tempfile.mkdtemp(prefix="roundtable-bench-"))
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=str(BIN / "temporal"),
        search_attributes=list(search_attributes.ALL),
        data_converter=data_converter(),
        ui=False,
    )
    address = env.client.service_client.config.target_host
    bench = Bench(workdir, address)
    try:
        bench.start_workers()
        ours_client = await connect(address, "default")
        bare_client = await Client.connect(address)
        ours: list[dict[str, float]] = []
        base: list[dict[str, float]] = []
        ours_worker, bare_worker = (w.pid for w in bench.workers)
        async with open_store(bench.url, migrate=False) as store:
            for i in range(warmup + approvals):
                if i == warmup:  # each worker serves its own side only
                    cpu = {"ours": cpu_seconds(ours_worker), "bare": cpu_seconds(bare_worker)}
                    if profile:
                        profile.mkdir(parents=True, exist_ok=True)
                        spies = [_profile(ours_worker, profile / "ours.txt")]
                        spies.append(_profile(bare_worker, profile / "bare.txt"))
                b = await bench.bare_once(bare_client)
                o = await bench.ours_once(ours_client, store)
                if i >= warmup:
                    base.append(b)
                    ours.append(o)
            if profile:
                for spy in spies:
                    spy.send_signal(signal.SIGINT)
                    spy.wait(timeout=60)
            cpu = {
                "ours": cpu_seconds(ours_worker) - cpu["ours"],
                "bare": cpu_seconds(bare_worker) - cpu["bare"],
            }
        history = await bench.history_events(ours_client)
    finally:
        bench.stop_workers()
        await env.shutdown()
        shutil.rmtree(workdir, ignore_errors=True)
    figures: dict[str, Any] = {"approvals": approvals, "history_events": history}
    per_approval = {side: round(1000 * spent / approvals, 1) for side, spent in cpu.items()}
    figures["worker_cpu_per_approval"] = {
        "what": "worker CPU per approval (user + system, whole run, ms)",
        "bare_ms": per_approval["bare"],
        "ours_ms": per_approval["ours"],
        "ratio": round(per_approval["ours"] / per_approval["bare"], 2)
        if per_approval["bare"]
        else None,
    }
    for key, what in (
        ("update", "decision call returns"),
        ("write", "decide → write recorded"),
        ("result", "decide → workflow result"),
    ):
        b, o = _summary(base, key), _summary(ours, key)
        figures[key] = {
            "what": what,
            "bare": b,
            "ours": o,
            "ratio_p50": round(o["p50_ms"] / b["p50_ms"], 2) if b["p50_ms"] else None,
            "ratio_p95": round(o["p95_ms"] / b["p95_ms"], 2) if b["p95_ms"] else None,
        }
    return figures


def _print(figures: dict[str, Any]) -> None:
    print(f"approvals: {figures['approvals']} each side, alternating")
    print(f"{'figure':<28}{'bare p50/p95 ms':>18}{'ours p50/p95 ms':>18}{'ratio p50/p95':>16}")
    for key in ("update", "write", "result"):
        f = figures[key]
        print(
            f"{f['what']:<28}"
            f"{f['bare']['p50_ms']:>9}/{f['bare']['p95_ms']:<8}"
            f"{f['ours']['p50_ms']:>9}/{f['ours']['p95_ms']:<8}"
            f"{f['ratio_p50']:>8}/{f['ratio_p95']}"
        )
    c = figures["worker_cpu_per_approval"]
    print(f"worker CPU per approval: bare {c['bare_ms']} ms, ours {c['ours_ms']} ms, ratio {c['ratio']}")
    h = figures["history_events"]
    print(
        f"history events: {h['ours_per_approved_write']} per approved write "
        f"(a one-write run: {h['ours_run_with_one_write']}; bare workflow: {h['bare_workflow']})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--approvals", type=int, default=200)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument(
        "--profile", type=Path, help="sample both workers with py-spy into this directory"
    )
    args = parser.parse_args()
    figures = asyncio.run(run(args.approvals, profile=args.profile))
    _print(figures)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    # Everything is written. Leave without interpreter finalization, which the
    # SDK's native threads were seen to abort ("PyGILState_Release ... must be
    # current"), failing `make bench` after its work was done.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
