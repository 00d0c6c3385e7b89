"""A tool call under a target lease: it runs only while the lease is ours,
and the lease is held for as long as the call runs.

Beside the call, a keeper holds the lease (extends it). The moment the lease
may be lost (a hold refused, failing, or slower than the time left), or the
action stops being ``executing`` (the workflow gave this attempt up), the call
is cancelled. The keeper goes on holding while the cancelled call winds down:
a call that has not ended keeps its target blocked and its action
unreconcilable, so no successor can write beside it.

The lease's expiry is tracked on this process's monotonic clock from the
moment each hold was *sent*: the database set the expiry from a later instant,
so our deadline falls before the database's. Heartbeats to Temporal run in
their own task for the whole attempt (claim included): a slow database must
never make a live attempt look dead.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from temporalio import activity

from roundtable.store.states import ActionStatus

# How long a cancelled tool call may take to wind down (while its lease is
# still held); a call that ignores cancellation longer is abandoned, and its
# attempt is then never taken to be over: the lease must run out.
CANCEL_GRACE_SECONDS = 30.0


@dataclass(frozen=True)
class LeaseTerms:
    lease_seconds: float
    heartbeat_interval_seconds: float
    # Monotonic time just before the claim was sent: the lease runs from after it.
    claimed_at: float

    @property
    def margin(self) -> float:
        """Stop this long before the lease could lapse: one renewal interval,
        so the call is cancelled while the lease is still certainly held."""
        return min(self.heartbeat_interval_seconds, self.lease_seconds / 2)


@dataclass
class CallOutcome:
    """How the call ended. ``lease_lost`` says why the keeper stopped it;
    ``interrupted``: this activity was cancelled (the caller must re-raise);
    ``finished`` is False only if the call ignored cancellation past the grace,
    so it may still be running."""

    result: Any = None
    error: BaseException | None = None
    lease_lost: str | None = None
    interrupted: bool = False
    finished: bool = True

    @property
    def stopped(self) -> bool:
        """The call did not run to its own end: its effect is unknown."""
        return self.lease_lost is not None or self.interrupted or not self.finished


# Extend the lease; the action's status while held, None once the lease is lost.
Hold = Callable[[], Awaitable[str | None]]


@contextlib.asynccontextmanager
async def heartbeating(interval: float) -> AsyncIterator[None]:
    """Tell Temporal the attempt is alive, every ``interval``, until the block ends."""

    async def beat() -> None:
        while True:
            with contextlib.suppress(Exception):
                activity.heartbeat()
            await asyncio.sleep(interval)

    beating = asyncio.ensure_future(beat())
    try:
        yield
    finally:
        beating.cancel()
        await asyncio.wait({beating})


async def _keep_lease(terms: LeaseTerms, hold: Hold, lost: asyncio.Future[str]) -> None:
    """Hold the lease until cancelled; settle ``lost`` with the reason the
    first time the lease may be lost or the action stops executing."""

    def lose(reason: str) -> None:
        if not lost.done():
            lost.set_result(reason)

    loop = asyncio.get_running_loop()
    deadline = terms.claimed_at + terms.lease_seconds - terms.margin
    while True:
        wake = loop.time() + terms.heartbeat_interval_seconds
        if not lost.done():
            wake = min(wake, deadline)
        await asyncio.sleep(max(wake - loop.time(), 0))
        if loop.time() >= deadline:
            lose("lease_expiring_unrenewed")
        sent = loop.time()
        try:
            budget = max(deadline - sent, terms.heartbeat_interval_seconds if lost.done() else 0)
            held = await asyncio.wait_for(hold(), timeout=max(budget, 0.001))
        except TimeoutError:
            lose("lease_renewal_timed_out")
            continue
        except Exception as exc:  # the database failed: we cannot know the lease holds
            activity.logger.warning("lease renewal failed: %s", type(exc).__name__)
            lose("lease_renewal_failed")
            continue
        if held is None:
            lose("lease_renewal_refused")
            return  # nothing left to hold
        deadline = sent + terms.lease_seconds - terms.margin
        if held != ActionStatus.EXECUTING:
            lose("action_no_longer_executing")


async def _wind_down(call: asyncio.Task[Any]) -> bool:
    """Cancel the call and wait until it has ended, or the grace runs out.
    A cancellation of this activity meanwhile (Temporal gave up on it, the
    worker is stopping) waits too: letting go while the call still runs would
    let its lease lapse under it. Returns whether such a cancellation came."""
    call.cancel()
    loop = asyncio.get_running_loop()
    give_up = loop.time() + CANCEL_GRACE_SECONDS
    interrupted = False
    while not call.done() and loop.time() < give_up:
        try:
            await asyncio.wait({call}, timeout=give_up - loop.time())
        except asyncio.CancelledError:
            interrupted = True
    return interrupted


def _ended(call: asyncio.Task[Any], **how: Any) -> CallOutcome:
    if not call.done():
        return CallOutcome(finished=False, **how)
    if call.cancelled():
        return CallOutcome(error=asyncio.CancelledError(), **how)
    if call.exception() is not None:
        return CallOutcome(error=call.exception(), **how)
    return CallOutcome(result=call.result(), **how)


async def call_under_lease(
    invoke: Callable[[], Awaitable[Any]], terms: LeaseTerms, hold: Hold
) -> CallOutcome:
    """Run ``invoke()`` while the lease holds; never raises what the call
    raised (it is in the outcome). If this activity is cancelled meanwhile, the
    call is wound down first and the outcome says ``interrupted``."""
    lost: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    call = asyncio.ensure_future(invoke())
    keeper = asyncio.ensure_future(_keep_lease(terms, hold, lost))
    try:
        try:
            await asyncio.wait({call, lost}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            await _wind_down(call)
            return _ended(call, interrupted=True)
        if call.done():
            return _ended(call)
        reason = lost.result()
        activity.logger.warning("lease may be lost (%s): cancelling the tool call", reason)
        interrupted = await _wind_down(call)
        # The call may have completed just as it was cancelled: the lease was
        # in doubt all the same, so its outcome is unknown.
        return _ended(call, lease_lost=reason, interrupted=interrupted)
    finally:
        keeper.cancel()
        await asyncio.wait({keeper})
