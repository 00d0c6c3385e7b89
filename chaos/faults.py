"""Faults at moments the seed chooses, one at a time, each logged with a
timestamp. A fault counts only once it really happened: a signal delivered to
a live process, an injected database failure the worker logged, a ticket
write observed to outlast the heartbeat timeout, an API killed while the bot
had a request in flight."""

from __future__ import annotations

import asyncio
import random
import signal
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from temporalio.client import Client

from chaos.operator_bot import OperatorBot
from chaos.stack import Proc, Stack
from chaos.workload import HEARTBEAT_SECONDS, LEASE_SECONDS
from roundtable.tools.tickets import TicketSystem

KINDS = (
    "worker_kill",
    "temporal_restart",
    "db_fail_record_result",
    "db_fail_renew",
    "worker_freeze",
    "api_kill",
    "slow_tickets",
)
# A frozen worker stays frozen past its lease, the workflow's heartbeat
# timeout and the bot's patience with a "started" write, so that a successor
# can claim the ticket before the late write arrives (and must be refused).
FREEZE_SECONDS = LEASE_SECONDS + 22
SLOW_WRITE_SECONDS = HEARTBEAT_SECONDS + 2
SLOW_WINDOW_SECONDS = 15
DB_WINDOW_SECONDS = 15
MIN_GAP_SECONDS = 4


def rounds_for(duration: float) -> int:
    """How many times each kind is injected: once per two minutes (a
    10-minute run injects every kind 5 times)."""
    return max(1, int(duration // 120))


def schedule(
    rng: random.Random, start: float, end: float, rounds: int = 1
) -> list[tuple[float, str]]:
    """Every kind ``rounds`` times: each round all kinds in a seeded order,
    the rounds spread evenly over [start, end)."""
    slots = []
    for _ in range(rounds):
        kinds = list(KINDS)
        rng.shuffle(kinds)
        slots += kinds
    span = max(end - start, 1.0)
    return [
        (start + span * (i + rng.random() * 0.5) / len(slots), kind) for i, kind in enumerate(slots)
    ]


@dataclass
class Faults:
    stack: Stack
    bot: OperatorBot
    tickets: TicketSystem
    temporal: Callable[[], Client | None]
    rng: random.Random
    t0: float
    counts: Counter[str] = field(default_factory=Counter)
    attempted: Counter[str] = field(default_factory=Counter)
    log: list[str] = field(default_factory=list)
    frozen: list[Proc] = field(default_factory=list)

    def note(self, kind: str, detail: str, injected: bool = True) -> None:
        stamp = datetime.now(UTC).isoformat(timespec="milliseconds")
        line = (
            f"[{time.monotonic() - self.t0:7.1f}s {stamp}] "
            f"{'fault' if injected else 'no fault'} {kind}: {detail}"
        )
        self.log.append(line)
        print(line, flush=True)
        if injected:
            self.counts[kind] += 1

    async def run(self, plan: list[tuple[float, str]], stop_at: float, rounds: int = 1) -> None:
        for moment, kind in plan:
            wait = moment - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            # Past the end (faults take their time), only kinds still short of
            # their rounds run: every kind gets its due, however slow the session.
            if time.monotonic() >= stop_at and self.counts[kind] >= rounds:
                continue
            self.attempted[kind] += 1
            try:
                await getattr(self, kind)()
            except Exception as exc:
                self.note(kind, f"the harness failed to inject it: {exc!r}", injected=False)
            await asyncio.sleep(MIN_GAP_SECONDS)

    # ----------------------------------------------------------------- processes

    def _normal_workers(self) -> list[Proc]:
        return [w for w in self.stack.live_workers() if w.name == "worker" and w not in self.frozen]

    async def worker_kill(self) -> None:
        victim = self.rng.choice(self._normal_workers())
        victim.signal(signal.SIGKILL)
        code = await asyncio.to_thread(victim.popen.wait, 10)
        self.note("worker_kill", f"SIGKILL worker pid {victim.pid} (exit {code})", code == -9)
        fresh = await asyncio.to_thread(self.stack.start_worker)
        self.note("worker_start", f"started worker pid {fresh.pid}", injected=False)

    async def temporal_restart(self) -> None:
        old = self.stack.temporal
        assert old is not None
        await asyncio.to_thread(self.stack.stop_temporal)
        self.note(
            "temporal_restart",
            f"stopped the dev server pid {old.pid} (exit {old.popen.returncode})",
            False,
        )
        await asyncio.sleep(self.rng.uniform(2, 6))
        new = await asyncio.to_thread(self.stack.start_temporal)
        self.note(
            "temporal_restart",
            f"dev server back as pid {new.pid} on the same database file",
            not old.alive() and new.alive(),
        )

    async def worker_freeze(self) -> None:
        victim, why = await self._writing_worker()
        victim.signal(signal.SIGSTOP)
        self.frozen.append(victim)
        self.note("worker_freeze", f"SIGSTOP worker pid {victim.pid} ({why})")
        try:
            await asyncio.sleep(FREEZE_SECONDS)
        finally:
            victim.signal(signal.SIGCONT)
            self.frozen.remove(victim)
        self.note("worker_thaw", f"SIGCONT worker pid {victim.pid}", injected=False)

    async def _writing_worker(self) -> tuple[Proc, str]:
        """A worker with a ticket write in flight, found through Temporal
        (the pending execute_write's worker identity is pid@host); else any."""
        by_pid = {w.pid: w for w in self._normal_workers()}
        client = self.temporal()
        for _ in range(40):
            started = [w for w in await self.tickets.write_log() if w["outcome"] == "started"]
            for write in started:
                run_id = write["idempotency_key"].split(":", 1)[0]
                try:
                    described = await client.get_workflow_handle(run_id).describe()  # type: ignore[union-attr]
                except Exception:  # noqa: S112 - a run we cannot describe right now
                    continue
                for pending in described.raw_description.pending_activities:
                    pid = pending.last_worker_identity.split("@", 1)[0]
                    if pending.activity_type.name == "execute_write" and pid.isdigit():
                        if int(pid) in by_pid:
                            return by_pid[int(pid)], f"mid-write on {write['ticket_id']}"
            await asyncio.sleep(0.25)
        return self.rng.choice(list(by_pid.values())), "no write seen in flight"

    async def api_kill(self) -> None:
        deadline = time.monotonic() + 15
        while self.bot.in_flight == 0 and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.002)
        paths = list(self.bot.in_flight_paths)
        api = self.stack.api
        assert api is not None
        api.signal(signal.SIGKILL)
        await asyncio.to_thread(api.popen.wait, 10)
        if paths:
            self.note("api_kill", f"SIGKILL API pid {api.pid} during {', '.join(paths)}")
        else:
            self.note("api_kill", f"SIGKILL API pid {api.pid} with no request in flight", False)
        new = await asyncio.to_thread(self.stack.start_api)
        self.note("api_start", f"API back as pid {new.pid}", injected=False)

    # ----------------------------------------------------------------- database and tickets

    async def _injected(self, point: str) -> int:
        return sum(
            log.read_text(errors="replace").count(f"chaos: injected database failure at {point}")
            for log in self.stack.logs.glob("worker-*.log")
        )

    async def _db_window(self, kind: str, point: str) -> None:
        before = await self._injected(point)
        self.stack.fault_file.write_text(f"{point}:0.5")
        deadline = time.monotonic() + DB_WINDOW_SECONDS
        while time.monotonic() < deadline and await self._injected(point) == before:  # noqa: ASYNC110
            await asyncio.sleep(0.5)
        self.stack.fault_file.write_text("")
        hits = await self._injected(point) - before
        self.note(kind, f"database failures injected at {point}: {hits}", hits > 0)
        self.counts[kind] += max(hits - 1, 0)

    async def db_fail_record_result(self) -> None:
        await self._db_window("db_fail_record_result", "record_result")

    async def db_fail_renew(self) -> None:
        await self._db_window("db_fail_renew", "renew")

    async def slow_tickets(self) -> None:
        """Workers whose ticket system answers slower than the heartbeat
        timeout: attempts must keep heartbeating and holding their leases.
        Two slow workers replace the normal ones for a window (those stop
        gracefully, finishing their writes), so writes really meet them."""
        delay = {"ROUNDTABLE_DEMO_TICKET_WRITE_DELAY_SECONDS": str(SLOW_WRITE_SECONDS)}
        slow = [await asyncio.to_thread(self.stack.start_worker, **delay) for _ in range(2)]
        for proc in slow:
            proc.name = "slow-worker"
        normal = self._normal_workers()
        began = datetime.now(UTC)
        await asyncio.gather(*(asyncio.to_thread(w.stop, 40) for w in normal))
        pids = ", ".join(str(p.pid) for p in slow)
        self.note(
            "slow_tickets_on", f"slow workers {pids}: writes take {SLOW_WRITE_SECONDS}s", False
        )
        await asyncio.sleep(SLOW_WINDOW_SECONDS)
        for _ in normal:
            await asyncio.to_thread(self.stack.start_worker)
        await asyncio.gather(*(asyncio.to_thread(w.stop, 40) for w in slow))
        slow_writes = [w for w in await self.tickets.write_log() if _slow(w, began)]
        self.note(
            "slow_tickets",
            f"{len(slow_writes)} writes outlasted the {HEARTBEAT_SECONDS}s heartbeat timeout",
            bool(slow_writes),
        )

    def restore(self) -> None:
        """Faults stop: thaw, disarm."""
        for proc in list(self.frozen):
            proc.signal(signal.SIGCONT)
        self.stack.fault_file.write_text("")


def _slow(write: dict[str, Any], since: datetime) -> bool:
    if not write["finished_at"]:
        return False
    started = datetime.fromisoformat(write["started_at"])
    finished = datetime.fromisoformat(write["finished_at"])
    return started >= since and (finished - started).total_seconds() > HEARTBEAT_SECONDS
