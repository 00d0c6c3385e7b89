"""One chaos session: bring the stack up, run the workload, the bot and the
faults for ``duration`` seconds, stop the faults, wait for quiescence, then run
the invariant checker and the canary scan."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from temporalio.client import Client

from chaos import canary as canaries
from chaos import recoveries
from chaos.faults import KINDS, Faults, rounds_for, schedule
from chaos.operator_bot import FINAL_RUNS, OperatorBot
from chaos.stack import Stack
from chaos.workload import Workload
from roundtable.config import Settings
from roundtable.evidence import gather, workflow_closed
from roundtable.invariants import check, summary
from roundtable.models import RunState
from roundtable.names import STATE_QUERY
from roundtable.store import open_store
from roundtable.temporal import connect
from roundtable.tools.tickets import TicketSystem

MIN_WORKERS = 2
MAX_OPEN_RUNS = 8
# The shortest session in which every fault kind fits (they run one at a time).
FULL_COVERAGE_SECONDS = 150


# How long store-final runs may take to close in Temporal (their last
# webhooks are retried with backoff) before the two are judged.
CLOSE_WITHIN = 120.0


@dataclass
class Outcome:
    summary: str = ""
    faults: Counter[str] = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)
    leaks: list[str] = field(default_factory=list)
    missing_kinds: list[str] = field(default_factory=list)
    unsettled: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.violations or self.leaks or self.missing_kinds)


def say(t0: float, text: str) -> None:
    print(f"[{time.monotonic() - t0:7.1f}s] {text}", flush=True)


class Session:
    def __init__(self, seed: int, duration: float, db: str, workdir: Path) -> None:
        self.seed, self.duration, self.db, self.workdir = seed, duration, db, workdir
        self.rng = random.Random(seed)  # noqa: S311 (chaos, not security)
        self.canary = f"CANARY{seed}Z{uuid.uuid4().hex[:16]}"
        self.t0 = time.monotonic()
        self.outcome = Outcome()
        self._temporal: Client | None = None

    def _seeded(self, stream: int) -> random.Random:
        """One random stream per part, so adding draws to one leaves the others alone."""
        return random.Random(self.seed * 100 + stream)  # noqa: S311 (chaos, not security)

    def temporal(self) -> Client | None:
        return self._temporal

    async def run(self) -> Outcome:
        pg = None
        if self.db == "postgres":
            from tests.pg_cluster import start_cluster

            pg = await asyncio.to_thread(start_cluster)
            url = pg.url()
        else:
            url = f"sqlite+aiosqlite:///{self.workdir / 'roundtable.db'}"
        sink = canaries.WebhookSink(self.workdir / "webhooks.log")
        stack = Stack(self.workdir, url, webhook_url=sink.url)
        # This process speaks to the stack too (typed client, checker).
        for name, value in stack.env().items():
            if name.startswith("ROUNDTABLE_") and not name.startswith("ROUNDTABLE_CHAOS"):
                os.environ[name] = value
        try:
            with sink.running():
                await self._session(stack, url, sink)
        finally:
            await asyncio.to_thread(stack.close)
            if pg is not None:
                await asyncio.to_thread(pg.stop)
        return self.outcome

    async def _session(self, stack: Stack, url: str, sink: canaries.WebhookSink) -> None:
        code, _ = await asyncio.to_thread(stack.cli, "db", "upgrade")
        assert code == 0, "roundtable db upgrade failed"
        code, made = await asyncio.to_thread(
            stack.cli, "tokens", "create", "--user", "chaos-operator", "--role", "operator"
        )
        assert code == 0 and isinstance(made, dict), made
        token = made["token"]
        await asyncio.to_thread(stack.start_temporal)
        for _ in range(MIN_WORKERS):
            await asyncio.to_thread(stack.start_worker)
        await asyncio.to_thread(stack.start_api)
        self._temporal = await connect(
            Settings(temporal_address=stack.address, temporal_namespace="default")
        )
        say(self.t0, f"stack up in {self.workdir} (db={self.db}, seed={self.seed})")

        tickets = await TicketSystem.open(url)
        bot = OperatorBot(stack.api_url, token, tickets, self._seeded(1), self.workdir / "bot.log")
        workload = Workload(stack, token, self._seeded(2), self.canary)
        faults = Faults(stack, bot, tickets, self.temporal, self._seeded(3), self.t0)
        bot_stop = asyncio.Event()
        bot_task = asyncio.create_task(bot.run(bot_stop))
        start = time.monotonic()
        end = start + self.duration
        rounds = rounds_for(self.duration)
        plan = schedule(faults.rng, start + 8, end - 10, rounds)
        supervisor = asyncio.create_task(self._supervise(stack, faults))
        try:
            fault_task = asyncio.create_task(faults.run(plan, end, rounds))
            await self._drive(workload, url, end, fault_task)
            say(self.t0, "workload stopped; waiting for the fault under way to end")
            await fault_task
            faults.restore()
            await self._recover(stack)
            say(self.t0, "faults stopped; waiting for quiescence")
            await self._quiesce(url, set(workload.started), bot)
            await self._audit_through_api(stack, token, set(workload.started))
        finally:
            bot_stop.set()
            supervisor.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await bot_task
            with contextlib.suppress(asyncio.CancelledError):
                await supervisor
        await self._check(url, tickets, set(workload.started), faults)
        await tickets.close()
        await self._scan(stack, url, sink)
        self.outcome.faults = faults.counts
        if self.duration >= FULL_COVERAGE_SECONDS:
            short = [k for k in KINDS if faults.counts[k] < rounds_for(self.duration)]
            self.outcome.missing_kinds = [
                f"{k} ({faults.counts[k]} of {rounds_for(self.duration)})" for k in short
            ]
        self.outcome.notes += [
            f"runs started: {len(workload.started)} by surface {dict(workload.surfaces)}",
            f"start errors: {len(workload.errors)}",
            f"bot: {dict(sorted(bot.counts.items()))}",
            f"webhooks received: {sink.count()}",
        ]

    async def _drive(
        self, workload: Workload, url: str, end: float, faults: asyncio.Task[None]
    ) -> None:
        """Start runs until the duration is over and the faults are done (they
        need traffic to bite)."""
        async with open_store(url) as store:
            while time.monotonic() < end or not faults.done():
                with contextlib.suppress(Exception):
                    open_runs = [
                        r for r in await store.list_runs() if r["status"] not in FINAL_RUNS
                    ]
                    if len(open_runs) < MAX_OPEN_RUNS:
                        await workload.start_one()
                await asyncio.sleep(workload.rng.uniform(1.0, 3.0))

    async def _supervise(self, stack: Stack, faults: Faults) -> None:
        """Two workers or more, whatever the faults do (a frozen one counts
        as alive: it is, and it will be back)."""
        while True:
            await asyncio.sleep(2)
            if len(stack.live_workers()) < MIN_WORKERS:
                fresh = await asyncio.to_thread(stack.start_worker)
                faults.note("worker_start", f"supervisor started worker pid {fresh.pid}", False)

    async def _recover(self, stack: Stack) -> None:
        if stack.temporal is None or not stack.temporal.alive():
            await asyncio.to_thread(stack.start_temporal)
        while len([w for w in stack.live_workers() if w.name == "worker"]) < MIN_WORKERS:
            await asyncio.to_thread(stack.start_worker)
        if stack.api is None or not stack.api.alive():
            await asyncio.to_thread(stack.start_api)

    async def _quiesce(self, url: str, started: set[str], bot: OperatorBot) -> None:
        """Until every run is final (the bot keeps working), or a timeout."""
        # A write that keeps finding its target busy retries on a timer that
        # backs off to a minute (workflows/timeouts.py), and nothing wakes it
        # when the target frees: give it three such retries after the last
        # writer of its ticket, so a starved write is not taken for a lost run.
        deadline = time.monotonic() + max(180.0, min(self.duration, 300.0))
        async with open_store(url) as store:
            while True:
                runs = [r for r in await store.list_runs() if r["id"] in started]
                open_runs = [r for r in runs if r["status"] not in FINAL_RUNS]
                if not open_runs:
                    say(self.t0, f"quiet: all {len(runs)} runs final")
                    await self._until_temporal_closes(runs)
                    return
                if time.monotonic() > deadline:
                    for run in open_runs:
                        actions = await store.list_actions(run["id"])
                        waiting = sorted(
                            a["status"]
                            for a in actions
                            if a["status"] not in ("succeeded", "failed", "rejected")
                        )
                        self.outcome.unsettled.append(f"{run['id']} {run['status']} {waiting}")
                        self.outcome.unsettled.append(await self._where_it_waits(run["id"]))
                    say(self.t0, f"quiescence timed out with {len(open_runs)} runs open")
                    return
                await asyncio.sleep(2)

    async def _until_temporal_closes(self, runs: list[dict[str, Any]]) -> None:
        """A run's store status is final before its workflow closes: the
        workflow then still delivers its last webhooks (retried for minutes
        against a receiver that refuses). Judge the two against each other
        only once the workflows have closed, or after CLOSE_WITHIN."""
        deadline = time.monotonic() + CLOSE_WITHIN
        open_ids = {r["id"] for r in runs}
        while open_ids and time.monotonic() < deadline:
            for run_id in sorted(open_ids):
                if await workflow_closed(self._temporal, run_id) is not False:
                    open_ids.discard(run_id)
            if open_ids:
                await asyncio.sleep(2)
        if open_ids:
            say(self.t0, f"{len(open_ids)} workflows still open {CLOSE_WITHIN:.0f}s after")
        else:
            say(self.t0, "every workflow closed")

    async def _where_it_waits(self, run_id: str) -> str:
        """Evidence for a run that did not settle: what its workflow is doing
        (pending activities, the details it shows) and its last events."""
        try:
            handle = self._temporal.get_workflow_handle(run_id)
            described = await handle.describe()
            pending = [
                f"{a.activity_type.name}(state={a.state}, attempt={a.attempt})"
                for a in described.raw_description.pending_activities
            ]
            events = [e async for e in handle.fetch_history_events()]
            last = [
                f"{e.event_id}:{e.WhichOneof('attributes')}@{e.event_time.ToDatetime():%H:%M:%S}"
                for e in events[-12:]
            ]
            state = await handle.query(STATE_QUERY, result_type=RunState)
            shows = (
                f"status={state.status} round={state.round} blocked={state.blocked_reason!r}"
                f" approvals={list(state.pending_approvals)} unknown={list(state.unknown_actions)}"
            )
            return (
                f"  {run_id}: temporal={described.status.name if described.status else '?'}"
                f" {shows} pending activities={pending}\n  last events: {last}"
            )
        except Exception as exc:  # evidence only: never fail the report on it
            return f"  {run_id}: no workflow evidence ({type(exc).__name__}: {exc})"

    async def _audit_through_api(self, stack: Stack, token: str, started: set[str]) -> None:
        """Read every run's audit log through the API, for the canary scan."""
        async with httpx.AsyncClient(
            base_url=stack.api_url, headers={"Authorization": f"Bearer {token}"}, timeout=30
        ) as http:
            with (self.workdir / "bot.log").open("a") as out:
                for run_id in sorted(started):
                    for path in (f"/v1/runs/{run_id}", f"/v1/runs/{run_id}/events"):
                        answer = await http.get(path)
                        out.write(f"GET {path} {answer.status_code} {answer.text}\n")
                answer = await http.get("/v1/webhook-deliveries")
                out.write(f"GET /v1/webhook-deliveries {answer.status_code} {answer.text}\n")

    async def _check(
        self, url: str, tickets: TicketSystem, started: set[str], faults: Faults
    ) -> None:
        async with open_store(url) as store:
            evidence = await gather(store, tickets, self._temporal, started_runs=started)
            recovered, unexplained = await recoveries.judge(
                store, self._temporal, started, self.workdir
            )
        violations = check(evidence)
        self.outcome.violations = [str(v) for v in violations] + unexplained
        self.outcome.notes += recovered
        self.outcome.summary = summary(evidence, violations, sum(faults.counts.values()))
        writes = Counter(w["outcome"] for w in evidence.ticket_writes)
        self.outcome.notes.append(f"ticket log outcomes: {dict(writes)}")
        statuses = Counter(a["status"] for a in evidence.actions)
        self.outcome.notes.append(f"action statuses: {dict(statuses)}")
        wide = sum(1 for a in evidence.actions if a.get("target_namespace_wide"))
        self.outcome.notes.append(f"namespace-wide actions: {wide}")
        reconciled = Counter(
            (a.get("result") or {}).get("reconciliation_note", "")
            for a in evidence.actions
            if (a.get("result") or {}).get("reconciled_outcome")
        )
        self.outcome.notes.append(f"reconciliations: {dict(reconciled)}")

    async def _scan(self, stack: Stack, url: str, sink: canaries.WebhookSink) -> None:
        leaks = await canaries.scan_database(url, self.canary)
        leaks += canaries.scan_files(stack.log_files(), self.canary, "log")
        temporal_files = sorted(self.workdir.glob("temporal.db*"))
        leaks += canaries.scan_files(temporal_files, self.canary, "temporal database file")
        read, found = await canaries.scan_temporal(stack.address, self.canary)
        leaks += found
        leaks += canaries.scan_files([self.workdir / "bot.log"], self.canary, "API responses")
        leaks += canaries.scan_files([sink.path], self.canary, "webhooks")
        planted = await canaries.planted(url, self.canary)
        if not planted:
            leaks.append("none: the canary never reached the ticket system (scan proves nothing)")
        self.outcome.leaks = leaks
        self.outcome.notes.append(f"canary planted in {planted} ticket rows (the outside world)")
        self.outcome.notes.append(f"canary scan: {read} raw Temporal histories read")
