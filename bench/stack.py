"""The stack every benchmark runs on: one `temporal server start-dev`, our
worker (`roundtable worker`, its own process, SQLite) and the bare worker
(bench/bare.py, its own process), each on its own task queue; and what is
read off a worker process (CPU, memory).
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

from temporalio.client import Client
from temporalio.testing import WorkflowEnvironment

from roundtable.config import SECRET_ENV_VAR, Settings
from roundtable.ports import free_port
from roundtable.store import Store, open_store
from roundtable.temporal import connect, data_converter
from workflows import search_attributes

BIN = Path(sys.executable).parent
OURS, BARE = "bench-roundtable", "bench-bare"


def _stat_cpu(stat: str) -> float:
    """User plus system CPU from a /proc ``stat`` line (a process's or a thread's)."""
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User plus system CPU a process has used so far (Linux /proc)."""
    return _stat_cpu(Path(f"/proc/{pid}/stat").read_text())


def python_thread_names(pid: int) -> dict[str, str]:
    """Each Python thread's name by its native id, from py-spy's dump of the
    process. The kernel knows most of a worker's threads only by the
    process's own name (Python 3.11 does not pass a thread's name down), so
    from /proc alone the SDK's workflow task threads look like aiosqlite's;
    until 2026-12-06 both were counted as "database and pool threads"."""
    dump = subprocess.run(  # noqa: S603
        [str(BIN / "py-spy"), "dump", "--pid", str(pid)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    names = dict(re.findall(r'^Thread (\d+) \([^)]*\): "([^"]*)"', dump.stdout, re.MULTILINE))
    if dump.returncode != 0 or str(pid) not in names:
        # Without names every thread but the loop and the core's would be
        # filed as "other": refuse rather than publish that.
        raise RuntimeError(f"py-spy could not name {pid}'s threads: {dump.stderr.strip()}")
    return names


def thread_kind(native_id: str, pid: int, kernel_name: str, python_name: str) -> str:
    """What a worker's thread does, by its ids and names (see thread_cpu)."""
    if native_id == str(pid):
        return "event loop"
    if kernel_name.startswith("tokio"):
        return "SDK core (Rust)"
    if kernel_name.startswith("workflow") or python_name.startswith("temporal_workflow"):
        return "workflow activations"
    if "_connection_worker_thread" in python_name:
        return "SQLite's threads (aiosqlite)"
    return "other threads (thread pools, unnamed)"


def thread_times(pid: int) -> dict[str, tuple[str, float]]:
    """Each thread's kernel name and CPU seconds so far, by its native id."""
    times: dict[str, tuple[str, float]] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        times[task.name] = (stat[stat.index("(") + 1 : stat.rindex(")")], _stat_cpu(stat))
    return times


def by_kind(
    times: dict[str, tuple[str, float]], pid: int, python_names: dict[str, str] | None = None
) -> dict[str, float]:
    """:func:`thread_times` summed by :func:`thread_kind`."""
    spent: dict[str, float] = {}
    for native_id, (kernel_name, seconds) in times.items():
        python_name = (python_names or {}).get(native_id, "")
        kind = thread_kind(native_id, pid, kernel_name, python_name)
        spent[kind] = spent.get(kind, 0.0) + seconds
    return spent


ENDED = "threads that ended in the window (not told apart)"


def window_by_kind(
    pid: int,
    before: dict[str, tuple[str, float]],
    python_names: dict[str, str],
    process_before: float,
) -> dict[str, float]:
    """Each kind of thread's CPU since ``before`` (:func:`thread_times`),
    thread by thread: a thread born since counts from zero; one that ended
    took its CPU with it (the kernel keeps no figure for it), so what the
    process spent beyond the living threads' is reported as :data:`ENDED`
    (SQLAlchemy's overflow connections, each with its thread, come and go
    under load). ``python_names``: taken at both ends of the window."""
    since = {
        native_id: (kernel_name, seconds - before.get(native_id, (kernel_name, 0.0))[1])
        for native_id, (kernel_name, seconds) in thread_times(pid).items()
    }
    spent = by_kind(since, pid, python_names)
    ended = cpu_seconds(pid) - process_before - sum(spent.values())
    if ended > 0.05:  # each thread's figure is in 10 ms ticks: below this is rounding
        spent[ENDED] = ended
    return spent


def thread_cpu(pid: int, python_names: dict[str, str] | None = None) -> dict[str, float]:
    """CPU seconds each kind of thread of a worker has used so far: the event
    loop (the process's first thread, where our code, SQLAlchemy and the
    SDK's Python run, and, while its connection's thread is idle, SQLite's
    statements), the SDK's core (Rust, named tokio-*), the workflow
    activations (the SDK's workflow task threads, ``temporal_workflow_*``),
    aiosqlite's threads (one per pooled connection), and the rest. Threads
    are told apart by their Python names when ``python_names`` has them
    (:func:`python_thread_names`); without, the SDK's workflow task threads
    and aiosqlite's fall in the rest. A profile's Python samples cannot show
    this: a thread waiting for the GIL is not busy, and SQLite and the SDK's
    core run without it."""
    return by_kind(thread_times(pid), pid, python_names)


def server_pid(address: str) -> int | None:
    """The dev server serving ``address`` (host:port), found by its command
    line: the SDK starts it and does not say which process it is."""
    port = address.rsplit(":", 1)[-1].encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if b"start-dev" in args and port in args:
            return int(entry.name)
    return None


def rss_kib(pid: int) -> int:
    """A process's resident memory now (VmRSS, KiB)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for {pid}")


class Stack:
    def __init__(self, workdir: Path, address: str, extra_env: dict[str, str]) -> None:
        self.workdir, self.address = workdir, address
        self.url = f"sqlite+aiosqlite:///{workdir / 'roundtable.db'}"
        self.bare_db = str(workdir / "bare.db")
        # Workers may cache bytecode, as an installed package has it (pip
        # compiles at install): otherwise the sandbox compiles the workflow
        # modules from source again for every run it starts.
        inherited = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        self.env = {
            **inherited,
            "ROUNDTABLE_DATABASE_URL": self.url,
            # The ticket system stands in for a customer's: a database of its
            # own, as the bare side writes its rows to a file of its own.
            "ROUNDTABLE_DEMO_TICKETS_URL": f"sqlite+aiosqlite:///{workdir / 'tickets.db'}",
            "ROUNDTABLE_TEMPORAL_ADDRESS": address,
            "ROUNDTABLE_TASK_QUEUE": OURS,
            "ROUNDTABLE_DEMO_TICKET_WRITE_DELAY_SECONDS": "0",
            "ROUNDTABLE_SWEEP_ENABLED": "false",
            # Metrics on, as in production, on a port of its own.
            "ROUNDTABLE_WORKER_METRICS_ADDRESS": f"127.0.0.1:{free_port()}",
            **extra_env,
        }
        self.ours: subprocess.Popen | None = None  # type: ignore[type-arg]
        self.bare: subprocess.Popen | None = None  # type: ignore[type-arg]
        # The dev server's process: its CPU per run is part of each side's cost.
        self.server: int | None = None
        self.ours_client: Client | None = None
        self.bare_client: Client | None = None
        self.store: Store | None = None
        self._log = (workdir / "workers.log").open("a")

    def start_ours(self, env: dict[str, str] | None = None) -> None:
        command = [str(BIN / "roundtable"), "worker"]
        self.ours = subprocess.Popen(  # noqa: S603
            command, env={**self.env, **(env or {})}, stdout=self._log, stderr=subprocess.STDOUT
        )

    def start_bare(self) -> None:
        command = [sys.executable, "-m", "bench.bare", "--address", self.address]
        command += ["--queue", BARE, "--db", self.bare_db]
        self.bare = subprocess.Popen(  # noqa: S603
            command, env=self.env, stdout=self._log, stderr=subprocess.STDOUT
        )

    def kill_ours(self) -> None:
        """SIGKILL, as a crash: no shutdown, no last heartbeat."""
        assert self.ours is not None
        self.ours.send_signal(signal.SIGKILL)
        self.ours.wait(timeout=30)

    def restart_ours(self, env: dict[str, str] | None = None) -> None:
        """A fresh worker process (an empty workflow cache)."""
        _stop(self.ours)
        self.start_ours(env)

    def restart_bare(self) -> None:
        _stop(self.bare)
        self.start_bare()

    def pids(self) -> dict[str, int]:
        assert self.ours is not None and self.bare is not None
        return {"ours": self.ours.pid, "bare": self.bare.pid}

    def stop(self) -> None:
        _stop(self.ours)
        _stop(self.bare)
        self._log.close()


def _stop(worker: subprocess.Popen | None) -> None:  # type: ignore[type-arg]
    if worker is None or worker.poll() is not None:
        return
    worker.terminate()
    try:
        worker.wait(timeout=30)
    except subprocess.TimeoutExpired:
        worker.kill()
        worker.wait(timeout=30)


# The dev server has one history shard, so Temporal's per-shard cap on how
# often the transfer queue is read (`history.transferProcessorMaxPollRPS`,
# 20 a second, which a cluster spreads over hundreds of shards) held the whole
# server. Back-to-back approvals go past it: a workflow task due after a write
# then waited up to 50 ms to be read, on whichever side came next, and the
# decide → workflow result ratio swung from 1.27 to 2.42 on the same code
# (bench/README.md, "The dev server's transfer queue"). Lifted for both sides.
SERVER_ARGS = ("--dynamic-config-value", "history.transferProcessorMaxPollRPS=10000")


@asynccontextmanager
async def stack(extra_env: dict[str, str] | None = None) -> AsyncIterator[Stack]:
    """A dev server, the schema, both workers, both clients and our store."""
    os.environ.setdefault(SECRET_ENV_VAR, "bench-" + uuid.uuid4().hex)
    workdir = Path(tempfile.mkdtemp(prefix="roundtable-bench-"))
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=str(BIN / "temporal"),
        # The SDK's own wait is 5 s, which a loaded machine has missed.
        dev_server_startup_timeout=timedelta(seconds=60),
        search_attributes=list(search_attributes.ALL),
        data_converter=data_converter(),
        ui=False,
        dev_server_extra_args=list(SERVER_ARGS),
    )
    address = env.client.service_client.config.target_host
    made = Stack(workdir, address, extra_env or {})
    made.server = server_pid(address)
    try:
        upgrade = [str(BIN / "roundtable"), "db", "upgrade"]
        await asyncio.to_thread(
            subprocess.run,
            upgrade,
            env=made.env,
            check=True,
            capture_output=True,
        )
        made.start_ours()
        made.start_bare()
        made.ours_client = await connect(
            Settings(temporal_address=address, temporal_namespace="default")
        )
        made.bare_client = await Client.connect(address)
        async with open_store(made.url, migrate=False) as store:
            made.store = store
            yield made
    finally:
        made.stop()
        await env.shutdown()
        shutil.rmtree(workdir, ignore_errors=True)


@contextmanager
def sampled(pids: dict[str, int], directory: Path | None, figure: str) -> Iterator[None]:
    """With ``directory``, py-spy samples each worker while the block runs,
    into ``<directory>/<figure>-<side>.txt`` (collapsed stacks), and each
    kind of thread's CPU over the block goes to ``...-<side>-threads.txt``.
    Only the thread holding the GIL is sampled (``--gil``): without it
    py-spy counted the event loop waiting for the GIL, just after handing a
    statement to SQLite's thread, as a quarter of the worker's time."""
    spies = []
    threads_before: dict[str, tuple[dict[str, tuple[str, float]], dict[str, str], float]] = {}
    if directory is not None:
        directory.mkdir(parents=True, exist_ok=True)
        for side, pid in pids.items():
            threads_before[side] = (thread_times(pid), python_thread_names(pid), cpu_seconds(pid))
            command = [str(BIN / "py-spy"), "record", "--pid", str(pid), "--format", "raw"]
            out = directory / f"{figure}-{side}.txt"
            command += ["--rate", "200", "--nonblocking", "--gil", "--output", str(out)]
            spies.append(
                subprocess.Popen(  # noqa: S603
                    command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
                )
            )
    try:
        yield
    finally:
        for spy in spies:
            spy.send_signal(signal.SIGINT)
            spy.wait(timeout=60)
        for side, (times, names, process) in threads_before.items():
            pid = pids[side]
            spent = window_by_kind(pid, times, {**names, **python_thread_names(pid)}, process)
            lines = [f"{kind}\t{seconds:.2f}" for kind, seconds in sorted(spent.items())]
            assert directory is not None
            (directory / f"{figure}-{side}-threads.txt").write_text("\n".join(lines) + "\n")


def summary(values_s: list[float]) -> dict[str, Any]:
    """p50 and p95 of durations given in seconds, in milliseconds."""
    values = sorted(v * 1000 for v in values_s)
    p95 = values[min(len(values) - 1, round(0.95 * (len(values) - 1)))]
    return {"p50_ms": round(statistics.median(values), 1), "p95_ms": round(p95, 1)}
