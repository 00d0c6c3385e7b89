"""Scaling out under load (issue 14), on PostgreSQL: a Temporal dev server, a
throwaway PostgreSQL cluster, one `roundtable worker --role workflows` and two
`--role tools` workers on the tool task queue, each its own process. A hundred
scripted runs (the chaos workload's shape) write to five tickets at once; one
tool worker is SIGKILLed mid-load and a replacement started.

Then: every run has completed or waits for a reconciliation (its own unknown
write, or a write blocked behind another's); the operator bot reconciles the
unknowns through the HTTP API from the ticket log, as a person would, and every
run completes; and the invariant checker (roundtable/invariants.py, the chaos
harness's) finds nothing over the ticket log, the store and Temporal: no write
sent twice (the log counts repeats of an idempotency key), no two writes to one
ticket overlapping, fencing tokens rising per ticket.

Nothing here judges time: the deadlines only turn a hang into a failure that
says where it stood."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import signal
import time
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from chaos.operator_bot import OperatorBot
from chaos.stack import Proc, Stack
from chaos.workload import HEARTBEAT_SECONDS, plan_run
from roundtable.client import RoundtableClient, RunInput
from roundtable.config import Settings
from roundtable.evidence import gather, workflow_closed
from roundtable.invariants import check
from roundtable.models import RunState
from roundtable.names import STATE_QUERY
from roundtable.states import FINAL_RUN_STATUSES
from roundtable.store import open_store
from roundtable.temporal import connect
from roundtable.tools.tickets import TicketSystem
from tests.ci import unavailable
from tests.pg_cluster import PgCluster, PostgresUnavailable, start_cluster
from workflows.timeouts import RETRY_BLOCKED_MAX

ROOT = Path(__file__).resolve().parent.parent
RUNS = 100
TICKETS = ("T-1", "T-2", "T-3", "T-4", "T-5")
TOOLS_QUEUE = "roundtable-tools"
AUTO = "auto_approve_up_to:R3"  # no approvals: every write runs as soon as it may
# Each write takes time, so an overlap would show in the log, and a worker
# killed while it writes is killed mid-write.
WRITE_DELAY = "0.3"
# Started runs may be in flight at once (the rest start as these end): enough
# to keep every ticket contended, few enough for a loaded 2-core machine.
OPEN_AT_ONCE = 30
# Kill a tool worker once this many writes (of about 400) have applied, with
# one under way: late enough that not every run is left behind the unknown.
KILL_AFTER_APPLIED = 150
MAX_KILLS = 3
# A run no longer moves once it has ended or waits for a person.
SETTLED = FINAL_RUN_STATUSES | {"waiting_input"}
QUERY_TIMEOUT = timedelta(seconds=60)  # a loaded machine answers slowly
# Against hangs only, never a judgement of speed: a phase fails when no run
# has moved on for this long (a failure then says where the load stood).
# Longer than a blocked write's longest retry timer, in case its wake-up
# (a refresh signal, best effort) was missed.
STALL_SECONDS = RETRY_BLOCKED_MAX.total_seconds() + 90


@pytest.fixture
def postgres() -> Iterator[PgCluster]:
    try:
        cluster = start_cluster()
    except PostgresUnavailable as exc:
        unavailable(f"PostgreSQL ({exc})", "apt-get install postgresql; `make system-deps`")
    try:
        yield cluster
    finally:
        cluster.stop()


def say(t0: float, text: str) -> None:
    print(f"[{time.monotonic() - t0:6.1f}s] {text}", flush=True)


def polling(proc: Proc, what: str) -> bool:
    """The worker said it polls (``what``: "workflows worker polling", …)."""
    if not proc.alive():
        raise AssertionError(f"{proc.name} exited: {proc.log.read_text()[-3000:]}")
    return what in proc.log.read_text(errors="replace")


async def until(probe: Any, within: float, what: str, step: float = 0.5) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if await probe():
            return
        await asyncio.sleep(step)
    raise AssertionError(f"not within {within:.0f} s: {what}")


class Progress:
    """Fails when ``remaining`` has not fallen for STALL_SECONDS: the
    machine may be slow (other suites run beside this one), never stuck."""

    def __init__(self, what: str) -> None:
        self.what, self.best, self.since = what, None, time.monotonic()

    def check(self, remaining: set[str] | int) -> None:
        count = remaining if isinstance(remaining, int) else len(remaining)
        if self.best is None or count < self.best:
            self.best, self.since = count, time.monotonic()
        stalled = time.monotonic() - self.since
        shown = remaining if isinstance(remaining, int) else sorted(remaining)
        assert stalled < STALL_SECONDS, f"{self.what}: no progress in {stalled:.0f} s: {shown}"


async def start_tool_worker(stack: Stack) -> Proc:
    delay = {"ROUNDTABLE_DEMO_TICKET_WRITE_DELAY_SECONDS": WRITE_DELAY}
    worker = await asyncio.to_thread(stack.start_worker, "--role", "tools", **delay)

    async def up() -> bool:
        return polling(worker, f"tools worker polling {TOOLS_QUEUE}")

    await until(up, 90, "a tool worker polls the tool task queue")
    return worker


@pytest.mark.timeout(1800)  # a backstop: Progress fails a stuck phase first
async def test_a_hundred_contending_runs_across_role_workers_keep_every_promise(
    postgres: PgCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    t0 = time.monotonic()
    url = postgres.url()
    # Every process of the stack runs this checkout's code, and routes tool
    # calls to the tool workers' queue (the workflows worker must know it too).
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("ROUNDTABLE_TOOL_TASK_QUEUE", TOOLS_QUEUE)
    stack = Stack(tmp_path, url, task_queue="scale-out")
    for name, value in stack.env().items():  # this process speaks to the stack too
        if name.startswith("ROUNDTABLE_") and not name.startswith("ROUNDTABLE_CHAOS"):
            monkeypatch.setenv(name, value)
    tickets: TicketSystem | None = None
    try:
        code, _ = await asyncio.to_thread(stack.cli, "db", "upgrade")
        assert code == 0, "roundtable db upgrade failed"
        code, made = await asyncio.to_thread(
            stack.cli, "tokens", "create", "--user", "scale-operator", "--role", "operator"
        )
        assert code == 0 and isinstance(made, dict), made
        await asyncio.to_thread(stack.start_temporal)
        flows = await asyncio.to_thread(stack.start_worker, "--role", "workflows")

        async def flows_up() -> bool:
            return polling(flows, "workflows worker polling scale-out")

        await until(flows_up, 90, "the workflows worker polls")
        tools = [await start_tool_worker(stack), await start_tool_worker(stack)]
        await asyncio.to_thread(stack.start_api)
        say(t0, f"stack up: workflows pid {flows.pid}, tools pids {[w.pid for w in tools]}")

        temporal = await connect(Settings(temporal_address=stack.address))
        client = RoundtableClient(temporal, stack.task_queue)
        tickets = await TicketSystem.open(url)
        async with open_store(url, migrate=False) as store:
            started = await load(stack, client, tickets, store, tools, t0)
            waiting = await settle(store, temporal, started, t0)
            say(t0, f"settled: {len(started) - len(waiting)} runs final, {len(waiting)} waiting")
            await reconcile_and_finish(stack, made["token"], tickets, store, started, t0)
            await until_closed(temporal, started)
            evidence = await gather(store, tickets, temporal, started_runs=started)
        violations = check(evidence)
        writes = Counter(w["outcome"] for w in evidence.ticket_writes)
        actions = Counter(a["status"] for a in evidence.actions)
        reconciled = sum(
            1 for a in evidence.actions if (a.get("result") or {}).get("reconciled_outcome")
        )
        say(t0, f"ticket log {dict(writes)}; actions {dict(actions)}; reconciled {reconciled}")
        assert not violations, "\n".join(str(v) for v in violations)
        statuses = Counter(r["status"] for r in evidence.runs)
        assert statuses == Counter({"completed": RUNS}), statuses
        # The load was what it says: every ticket written, by many runs.
        assert {w["ticket_id"] for w in evidence.ticket_writes} == set(TICKETS)
        assert writes["applied"] >= RUNS, writes
    finally:
        if tickets is not None:
            await tickets.close()
        await asyncio.to_thread(stack.close)
        say(t0, "stack stopped")


async def load(
    stack: Stack,
    client: RoundtableClient,
    tickets: TicketSystem,
    store: Any,
    tools: list[Proc],
    t0: float,
) -> set[str]:
    """Start RUNS runs, at most OPEN_AT_ONCE unfinished at a time, and kill a
    tool worker in the middle of a write (see Killer). The run ids started."""
    rng = random.Random(14)  # noqa: S311 (a workload, not security)
    started: set[str] = set()
    killer = Killer(stack, tickets, client.temporal, store, tools, t0)

    async def start(index: int) -> None:
        plan = plan_run(rng, "no-canary", index, tickets=TICKETS, wide_share=0.0)
        plan = dataclasses.replace(plan, policy=AUTO)
        handle = await client.start_run(RunInput(**plan.run_input(), run_id=f"scale-{index}"))
        started.add(handle.run_id)

    # Read from the store, not by querying each workflow: a query needs the
    # workflows worker, which is the busiest process here.
    index, moving = 0, set()
    progress = Progress("runs still moving")
    while index < RUNS or moving:
        while index < RUNS and len(moving) < OPEN_AT_ONCE:
            await start(index)
            index += 1
            moving.add(f"scale-{index - 1}")
        await asyncio.sleep(1)
        runs = [r for r in await store.list_runs() if r["id"] in started]
        moving = started - {r["id"] for r in runs if r["status"] in SETTLED}
        await killer.step()
        progress.check(RUNS - index + len(moving))
    say(t0, f"all {RUNS} runs started and settled or waiting")
    await killer.judge_last()
    assert killer.kills, "the load ended before a tool worker could be killed mid-write"
    assert killer.unknowns, f"{killer.kills} kills, none mid-write (no unknown action)"
    return started


class Killer:
    """Once KILL_AFTER_APPLIED writes have applied: find a write under way
    (the ticket log says ``started``), the tool worker running it (its
    ``execute_write`` activity's worker identity is ``pid@host``), SIGKILL that
    worker and start a replacement. If no action turns ``unknown`` (the write
    finished between the look and the kill), try again, at most MAX_KILLS
    times."""

    def __init__(
        self,
        stack: Stack,
        tickets: TicketSystem,
        temporal: Any,
        store: Any,
        tools: list[Proc],
        t0: float,
    ) -> None:
        self.stack, self.tickets, self.temporal, self.store = stack, tickets, temporal, store
        self.tools, self.t0 = tools, t0
        self.kills, self.unknowns = 0, 0
        self._judge_after = 0.0

    async def judge(self) -> None:
        """Whether a kill has left an action unknown (the store says)."""
        _, self.unknowns = await self.store.open_work()

    async def judge_last(self) -> None:
        """Judge the last kill once its write's heartbeat has run out (the
        runs may all have settled before it did)."""
        await asyncio.sleep(max(0.0, self._judge_after - time.monotonic()))
        await self.judge()

    async def step(self) -> None:
        if self.unknowns:
            return
        if self.kills:
            # The last kill is judged too, not only those before a retry.
            await self.judge()
            if self.unknowns or time.monotonic() < self._judge_after:
                return
        if self.kills >= MAX_KILLS:
            return
        log = await self.tickets.write_log()
        if sum(1 for w in log if w["outcome"] == "applied") < KILL_AFTER_APPLIED:
            return
        for write in (w for w in log if w["outcome"] == "started"):
            victim = await self._running(write["idempotency_key"].split(":")[0])
            if victim is not None:
                await self._kill(victim, write["idempotency_key"])
                return

    async def _running(self, run_id: str) -> Proc | None:
        """The live tool worker running one of this run's writes, if any."""
        described = await self.temporal.get_workflow_handle(run_id).describe()
        for pending in described.raw_description.pending_activities:
            if pending.activity_type.name != "execute_write":
                continue
            pid = pending.last_worker_identity.split("@")[0]
            for worker in self.tools:
                if str(worker.pid) == pid and worker.alive():
                    return worker
        return None

    async def _kill(self, victim: Proc, key: str) -> None:
        victim.signal(signal.SIGKILL)
        await asyncio.to_thread(victim.popen.wait, 30)
        self.kills += 1
        say(self.t0, f"SIGKILLed tool worker {victim.pid}, writing {key}")
        self.tools.remove(victim)
        self.tools.append(await start_tool_worker(self.stack))
        say(self.t0, f"replacement tool worker {self.tools[-1].pid} polls")
        # The write's heartbeat (HEARTBEAT_SECONDS) must run out before its
        # action is unknown: only then is a miss a miss.
        self._judge_after = time.monotonic() + 4 * HEARTBEAT_SECONDS


async def settle(store: Any, temporal: Any, started: set[str], t0: float) -> set[str]:
    """Wait until every run is final or waiting for a reconciliation; the ids
    of those waiting. A waiting run must say why: an unknown write of its own,
    or a write blocked behind another's (RunState.blocked_writes)."""

    async def moving() -> set[str]:
        runs = {r["id"]: r["status"] for r in await store.list_runs() if r["id"] in started}
        return {i for i in started if runs.get(i) not in SETTLED}

    await until_none(moving, "runs neither final nor waiting")
    runs = [r for r in await store.list_runs() if r["id"] in started]
    open_ids = {r["id"] for r in runs if r["status"] not in FINAL_RUN_STATUSES}
    for run_id in sorted(open_ids):
        handle = temporal.get_workflow_handle(run_id)
        state = await handle.query(STATE_QUERY, result_type=RunState, rpc_timeout=QUERY_TIMEOUT)
        assert state.unknown_actions or state.blocked_writes, (run_id, state.status)
    say(t0, f"{len(open_ids)} waiting for reconciliation, {sorted(open_ids)[:5]}…")
    return open_ids


async def reconcile_and_finish(
    stack: Stack, token: str, tickets: TicketSystem, store: Any, started: set[str], t0: float
) -> None:
    """The operator bot reconciles every unknown from the ticket log (HTTP
    API, operator token) until every run has ended."""
    bot = OperatorBot(stack.api_url, token, tickets, random.Random(1), stack.workdir / "bot.log")  # noqa: S311
    stop = asyncio.Event()
    task = asyncio.create_task(bot.run(stop))

    async def open_runs() -> set[str]:
        runs = [r for r in await store.list_runs() if r["id"] in started]
        return {r["id"] for r in runs if r["status"] not in FINAL_RUN_STATUSES}

    try:
        await until_none(open_runs, "runs not final after reconciliation")
    finally:
        stop.set()
        await task
    say(t0, f"every run final; operator bot: {dict(sorted(bot.counts.items()))}")


async def until_closed(temporal: Any, started: set[str]) -> None:
    """Store-final runs close in Temporal a moment later: judge the two once closed."""
    remaining = set(started)

    async def still_open() -> set[str]:
        for run_id in sorted(remaining):
            if await workflow_closed(temporal, run_id) is not False:
                remaining.discard(run_id)
        return remaining

    await until_none(still_open, "workflows open in Temporal")


async def until_none(probe: Any, what: str) -> None:
    """Until ``probe()`` (a set of run ids) is empty, while it keeps shrinking."""
    progress = Progress(what)
    while remaining := await probe():
        progress.check(remaining)
        await asyncio.sleep(2)
