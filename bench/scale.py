"""The scale curve (issue 14): runs/s with 1, 2 and 3 worker processes on
PostgreSQL, and where each run's CPU goes.

The run shape is throughput.py's (three seats, two rounds, a manager, two
auto-approved writes, each on a ticket of its own), N runs started at once
until the last result, on one `temporal server start-dev` and a throwaway
PostgreSQL cluster (the store and, in a database of its own, the demo ticket
system). The split for N processes is the deployment the README recommends,
each its own `roundtable worker` process:

- 1: one worker, ``--role all`` (everything in one process);
- 2: one ``--role workflows`` + one ``--role tools`` (tool task queue);
- 3: one ``--role workflows`` + two ``--role tools``.

Splitting by role rather than adding all-role workers is what says most: it
shows whether the workflow side or the tool side is the one to add to. Each
N gets fresh databases and fresh workers, a warm-up batch, then the timed
batch; CPU (``/proc``) is read before and after it for every worker, the
dev server and PostgreSQL (the postmaster and its backends), so the figure
also says how busy the machine was: all CPU used over wall time times cores.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from bench import throughput
from bench.stack import OURS, cpu_seconds
from chaos.stack import Proc, Stack
from roundtable.config import SECRET_ENV_VAR, Settings
from roundtable.ports import free_port
from roundtable.temporal import connect

TOOLS_QUEUE = "bench-tools"
WORKDIR_PREFIX = "roundtable-scale-"
SPLITS: dict[int, tuple[str, ...]] = {
    1: ("all",),
    2: ("workflows", "tools"),
    3: ("workflows", "tools", "tools"),
}


class ScaleStack(Stack):
    """The chaos harness's process handling (each child dies with us, is
    stopped by its pid), with the benchmark's environment."""

    url: str = ""
    tickets_url: str = ""

    def env(self, **extra: str) -> dict[str, str]:
        inherited = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        return {
            **inherited,
            "ROUNDTABLE_DATABASE_URL": self.url or self.database_url,
            "ROUNDTABLE_DEMO_TICKETS_URL": self.tickets_url or self.database_url,
            "ROUNDTABLE_TEMPORAL_ADDRESS": self.address,
            "ROUNDTABLE_TASK_QUEUE": OURS,
            "ROUNDTABLE_DEMO_TICKET_WRITE_DELAY_SECONDS": "0",
            "ROUNDTABLE_SWEEP_ENABLED": "false",
            **throughput.WORKER_ENV,
            **extra,
        }


def _pg_cpu(postmaster: int) -> float:
    """PostgreSQL's CPU so far: the postmaster with its reaped backends, plus
    the backends alive now."""
    fields = Path(f"/proc/{postmaster}/stat").read_text().rsplit(")", 1)[1].split()
    total = sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(stat[1]) == postmaster:
                total += (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            continue  # a backend that just ended
    return total


def _cpu(pids: dict[str, list[int]], postmaster: int) -> dict[str, float]:
    taken = {part: sum(cpu_seconds(pid) for pid in group) for part, group in pids.items()}
    taken["postgresql"] = _pg_cpu(postmaster)
    return taken


async def _databases(admin_url: str, *names: str) -> None:
    engine = create_async_engine(admin_url, isolation_level="AUTOCOMMIT")
    try:
        async with engine.connect() as conn:
            for name in names:
                await conn.execute(text(f'CREATE DATABASE "{name}"'))
    finally:
        await engine.dispose()


async def _workers(stack: ScaleStack, split: tuple[str, ...]) -> list[Proc]:
    """Start one process a role in ``split``; return once each one polls."""
    queue = {} if set(split) == {"all"} else {"ROUNDTABLE_TOOL_TASK_QUEUE": TOOLS_QUEUE}
    workers = []
    for role in split:
        metrics = {"ROUNDTABLE_WORKER_METRICS_ADDRESS": f"127.0.0.1:{free_port()}"}
        workers.append(stack.start_worker("--role", role, **queue, **metrics))
    deadline = time.monotonic() + 120
    for worker, role in zip(workers, split, strict=True):
        while f"{role} worker polling" not in worker.log.read_text(errors="replace"):
            if not worker.alive() or time.monotonic() > deadline:
                raise RuntimeError(f"worker {role} did not start: {worker.log.read_text()[-2000:]}")
            await asyncio.sleep(0.2)
    return workers


async def _one(
    stack: ScaleStack, n: int, runs: int, postmaster: int, all_role: bool
) -> dict[str, Any]:
    split = ("all",) * n if all_role else SPLITS[n]
    suffix = f"{n}_{uuid.uuid4().hex[:6]}"
    await _databases(stack.database_url, f"rt_{suffix}", f"tickets_{suffix}")
    base = stack.database_url.rsplit("/", 1)[0]
    stack.url, stack.tickets_url = f"{base}/rt_{suffix}", f"{base}/tickets_{suffix}"
    code, _ = await asyncio.to_thread(stack.cli, "db", "upgrade")
    assert code == 0, "roundtable db upgrade failed"
    workers = await _workers(stack, split)
    try:
        client = await connect(Settings(temporal_address=stack.address))
        made = SimpleNamespace(ours_client=client)
        await throughput.run_ours(made, min(runs, 5))  # warm the workers
        pids: dict[str, list[int]] = {}
        for worker, role in zip(workers, split, strict=True):
            pids.setdefault(f"{role} worker", []).append(worker.pid)
        pids["temporal"] = [stack.temporal.pid] if stack.temporal else []
        before, started = _cpu(pids, postmaster), time.perf_counter()
        await throughput.run_ours(made, runs)
        seconds = time.perf_counter() - started
        after = _cpu(pids, postmaster)
    finally:
        for worker in workers:
            await asyncio.to_thread(worker.stop)
    used = {part: after[part] - before[part] for part in after}
    return {
        "workers": n,
        "split": " + ".join(split),
        "runs": runs,
        "runs_per_s": round(runs / seconds, 2),
        "cpu_ms_per_run": {part: round(1000 * cpu / runs, 1) for part, cpu in used.items()},
        # All the CPU the parts used over what the machine had in that time.
        "machine_busy": round(sum(used.values()) / (seconds * (os.cpu_count() or 1)), 2),
    }


async def measure(
    runs: int, sizes: tuple[int, ...] = (1, 2, 3), all_role: bool = False
) -> dict[str, Any]:
    """runs/s at each size, on a throwaway PostgreSQL cluster (without one,
    the figure says why it is missing, as claims.py's does). ``all_role``: N
    all-role workers instead of the role split (the comparison in the
    README, `python -m bench.scale --all-role`)."""
    try:
        from tests.pg_cluster import PostgresUnavailable, start_cluster
    except ImportError:
        return {"skipped": "run from the repository root for a throwaway cluster"}
    os.environ.setdefault(SECRET_ENV_VAR, "bench-" + uuid.uuid4().hex)
    try:
        cluster = await asyncio.to_thread(start_cluster)
    except PostgresUnavailable as exc:
        return {"skipped": str(exc)}
    workdir = Path(tempfile.mkdtemp(prefix=WORKDIR_PREFIX))
    stack = ScaleStack(workdir, cluster.url())
    measured = False
    try:
        postmaster = int((cluster.data_dir / "postmaster.pid").read_text().split()[0])
        await asyncio.to_thread(stack.start_temporal)
        curve = [await _one(stack, n, runs, postmaster, all_role) for n in sizes]
        measured = True
    finally:
        await asyncio.to_thread(stack.close)
        await asyncio.to_thread(cluster.stop)
        # The dev server's database and the workers' logs: kept only when
        # the curve failed, for whoever looks into why (every run of `make
        # bench` and of its smoke form in `make test` left one before).
        if measured:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"scale: the stack's logs are kept in {workdir}", file=sys.stderr)
    return {"runs_at_once": runs, "cores": os.cpu_count(), "curve": curve}


def main() -> None:
    import argparse
    import json

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=40, help="runs at once at each point")
    parser.add_argument("--all-role", action="store_true", help="N all-role workers instead")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    figures = asyncio.run(measure(args.runs, all_role=args.all_role))
    print(json.dumps(figures, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"scale": figures}, indent=2) + "\n")


if __name__ == "__main__":
    main()
