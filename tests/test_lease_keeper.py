"""The lease keeper's timing, against a database lease simulated exactly:
each committed hold sets the expiry a lease length on; a hold cancelled
before it commits changes nothing. (The real store's holds are tested in
test_store_leases.py and, end to end, in test_lease_loss.py.)"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from activities import lease_keeper
from activities.lease_keeper import LeaseTerms, call_under_lease


@dataclass
class SimulatedLease:
    length: float
    expiry: float = 0.0
    holds: int = 0
    stall_on: set[int] = field(default_factory=set)  # these holds hang (then are cancelled)
    refused_while_alive: list[float] = field(default_factory=list)
    status: str = "executing"

    def start(self) -> None:
        self.expiry = asyncio.get_running_loop().time() + self.length

    async def hold(self, call_alive: dict) -> str | None:
        self.holds += 1
        if self.holds in self.stall_on:
            await asyncio.sleep(60)
        await asyncio.sleep(0.005)
        now = asyncio.get_running_loop().time()
        if now >= self.expiry:
            if call_alive["alive"]:
                self.refused_while_alive.append(now)
            return None
        self.expiry = now + self.length
        return self.status


def slow_to_stop(alive: dict, stop_after: float):  # type: ignore[no-untyped-def]
    async def invoke() -> dict:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            await asyncio.sleep(stop_after)  # the request has to come back first
            raise
        finally:
            alive["alive"] = False
        return {}

    return invoke


def terms(length: float, interval: float) -> LeaseTerms:
    return LeaseTerms(length, interval, asyncio.get_running_loop().time())


async def test_a_stalled_hold_is_retried_before_the_lease_can_lapse() -> None:
    """Found in review: after one hold timed out, the keeper slept a whole
    interval and its next hold came just as the lease lapsed, under a call
    still winding down."""
    lease, alive = SimulatedLease(length=3.0, stall_on={3}), {"alive": True}
    lease.start()
    outcome = await call_under_lease(
        slow_to_stop(alive, stop_after=2.0), terms(3.0, 0.5), lambda: lease.hold(alive)
    )
    assert outcome.lease_lost == "lease_renewal_timed_out" and outcome.finished
    assert lease.refused_while_alive == []  # held for as long as the call ran


async def test_the_keeper_stops_even_if_a_hold_completes_as_it_is_told_to() -> None:
    """Found in review: asyncio.wait_for on Python 3.11 swallows a
    cancellation that lands as the awaited call completes; the keeper then
    held the lease for ever."""
    loop = asyncio.get_running_loop()
    release = loop.create_future()
    holds = 0

    async def hold() -> str:
        nonlocal holds
        holds += 1
        if holds == 2:  # the keeper's first hold ends together with the call
            await release
        return "executing"

    async def invoke() -> dict:
        await release
        return {"ok": True}

    running = asyncio.ensure_future(call_under_lease(invoke, terms(3.0, 0.1), hold))
    await asyncio.sleep(0.15)
    release.set_result(None)
    done, _ = await asyncio.wait({running}, timeout=2)
    assert done and running.result().result == {"ok": True}
    settled = holds
    await asyncio.sleep(0.3)
    assert holds == settled  # nothing holds the lease any more


@pytest.mark.parametrize("answer", [None, "unknown"])
async def test_nothing_is_invoked_unless_the_lease_is_held_at_the_start(answer) -> None:  # type: ignore[no-untyped-def]
    invoked = []

    async def hold() -> str | None:
        return answer

    async def invoke() -> dict:
        invoked.append(True)
        return {}

    outcome = await call_under_lease(invoke, terms(3.0, 0.1), hold)
    assert not outcome.started and outcome.lease_lost == "lease_not_held_at_start"
    assert invoked == []


async def test_an_abandoned_call_keeps_its_lease_until_it_ends(monkeypatch) -> None:
    """A call ignoring cancellation past the grace is left behind by the
    activity, not by its lease."""
    monkeypatch.setattr(lease_keeper, "CANCEL_GRACE_SECONDS", 0.3)
    lease, alive = SimulatedLease(length=1.0), {"alive": True}
    lease.start()

    async def gives_up_on_it() -> None:  # the workflow makes the action unknown
        await asyncio.sleep(0.3)
        lease.status = "unknown"

    giving_up = asyncio.ensure_future(gives_up_on_it())
    outcome = await call_under_lease(
        slow_to_stop(alive, stop_after=3.0), terms(1.0, 0.2), lambda: lease.hold(alive)
    )
    await giving_up
    assert not outcome.finished and outcome.lease_lost == "action_no_longer_executing"
    await asyncio.wait(lease_keeper._GUARDS)  # the activity is over; the call is not
    assert not alive["alive"]
    assert lease.refused_while_alive == []
    settled = lease.holds
    await asyncio.sleep(0.6)
    assert lease.holds == settled  # and once it ended, the guard let go
