"""A tool call under a target lease: it starts only while the lease is
certainly ours, and the lease is held for as long as the call runs.

Beside the call, a keeper holds the lease (extends it). The moment the lease
may be lost (a hold refused, failing, or slower than the time left), or the
action stops being ``executing`` (the workflow gave this attempt up), the call
is cancelled. The keeper goes on holding until the cancelled call has ended,
even past the activity (a call that ignores cancellation is guarded in the
background): a call that has not ended keeps its target blocked and its
action unreconcilable, so no successor can write beside it.

The lease's expiry is tracked on this process's monotonic clock from the
moment each hold was *sent*: the database set the expiry from a later instant,
so our estimate falls before the database's. Heartbeats to Temporal run in
their own task for the whole attempt (claim included): a slow database must
never make a live attempt look dead.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from temporalio import activity

from roundtable.states import ActionStatus

# How long a cancelled tool call may take to wind down inside the activity; a
# call that ignores cancellation longer is left to a background guard that
# holds its lease until it ends, and its attempt is never taken to be over.
CANCEL_GRACE_SECONDS = 30.0
# Work that outlives its activity, kept referenced until done: guards of calls
# that ignored cancellation, holds still under way when their keeper stopped.
_GUARDS: set[asyncio.Task[None]] = set()


@dataclass(frozen=True)
class LeaseTerms:
    lease_seconds: float
    heartbeat_interval_seconds: float
    # Monotonic time just before the claim was sent: the lease runs from after it.
    claimed_at: float

    @property
    def margin(self) -> float:
        """Cancel this long before the lease could lapse: one renewal interval,
        so the call is stopped while the lease is still certainly held."""
        return min(self.heartbeat_interval_seconds, self.lease_seconds / 2)


@dataclass
class CallOutcome:
    """How the call ended. ``lease_lost`` says why the keeper stopped it (or
    why it never started: ``started`` False, nothing was invoked);
    ``interrupted``: this activity was cancelled (the caller must re-raise);
    ``finished`` is False only if the call ignored cancellation past the grace,
    so it may still be running."""

    result: Any = None
    error: BaseException | None = None
    lease_lost: str | None = None
    interrupted: bool = False
    finished: bool = True
    started: bool = True

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


@dataclass
class _Keeper:
    """The lease as this attempt knows it. Holds are never cancelled (an
    abandoned database call can leave the database locked): a slow one is
    waited for, and the lease counted as in doubt meanwhile."""

    terms: LeaseTerms
    hold: Hold
    lost: asyncio.Future[str]
    # The latest instant (monotonic) by which the database's lease surely runs.
    expires: float = 0.0
    stopping: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.expires = self.terms.claimed_at + self.terms.lease_seconds

    def lose(self, reason: str) -> None:
        if not self.lost.done():
            self.lost.set_result(reason)

    async def hold_once(self, call_running: bool = True) -> str | None:
        """One hold, waited for to its end. While it is slower than one
        interval (or than the time the lease has left) and a call is running,
        the lease is in doubt: ``lost`` is settled, so the call is stopped,
        but the hold goes on. Raises the database's error; a success moves
        ``expires``."""
        loop = asyncio.get_running_loop()
        sent = loop.time()
        attempt = asyncio.ensure_future(self.hold())
        while not attempt.done():
            budget = min(self.terms.heartbeat_interval_seconds, self.expires - loop.time())
            done, _ = await asyncio.wait({attempt}, timeout=max(budget, 0.001))
            if not done and call_running:
                self.lose("lease_renewal_timed_out")
        held = attempt.result()
        if held is not None:
            self.expires = sent + self.terms.lease_seconds
        return held

    async def _pause(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(seconds, 0)):
                await self.stopping.wait()

    async def keep(self) -> None:
        """Hold the lease until told to stop or it is gone; settle ``lost``
        the first time it may be lost or the action stops executing."""
        loop = asyncio.get_running_loop()
        terms = self.terms
        while not self.stopping.is_set():
            wake = loop.time() + terms.heartbeat_interval_seconds
            if not self.lost.done():
                wake = min(wake, self.expires - terms.margin)
            await self._pause(wake - loop.time())
            if self.stopping.is_set():
                return
            if loop.time() >= self.expires - terms.margin:
                self.lose("lease_expiring_unrenewed")
            try:
                held = await self.hold_once()
            except Exception as exc:  # the database failed: the lease is in doubt
                activity.logger.warning("lease renewal failed: %s", type(exc).__name__)
                self.lose("lease_renewal_failed")
                await self._pause(min(0.2, terms.heartbeat_interval_seconds))
                continue
            if held is None:
                self.lose("lease_renewal_refused")
                return  # nothing left to hold
            if held != ActionStatus.EXECUTING:
                self.lose("action_no_longer_executing")

    def stop(self, task: asyncio.Task[None]) -> None:
        """Stop holding. A hold under way is neither waited for (the database
        may be stalled) nor cancelled: it ends on its own, in the background."""
        self.stopping.set()
        if not task.done():
            _GUARDS.add(task)
            task.add_done_callback(_GUARDS.discard)


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


async def _guard(call: asyncio.Task[Any], keeper: _Keeper, task: asyncio.Task[None]) -> None:
    """Outlive the activity: hold the lease until the abandoned call ends."""
    with contextlib.suppress(BaseException):
        await asyncio.wait({call})
    keeper.stop(task)


async def call_under_lease(
    invoke: Callable[[], Awaitable[Any]], terms: LeaseTerms, hold: Hold
) -> CallOutcome:
    """Run ``invoke()`` while the lease holds; never raises what the call
    raised (it is in the outcome). If this activity is cancelled meanwhile, the
    call is wound down first and the outcome says ``interrupted``."""
    keeper = _Keeper(terms, hold, asyncio.get_running_loop().create_future())
    # The claim, the reads since: time has passed. Invoke nothing unless a
    # hold right now says the lease is still ours and the action executing.
    try:
        first = await keeper.hold_once(call_running=False)
    except Exception as exc:  # a timeout or the database's error: in doubt
        reason = f"lease_not_held_at_start ({type(exc).__name__})"
        return CallOutcome(lease_lost=reason, started=False)
    if first != ActionStatus.EXECUTING:
        return CallOutcome(lease_lost="lease_not_held_at_start", started=False)

    call = asyncio.ensure_future(invoke())
    keeping = asyncio.ensure_future(keeper.keep())
    try:
        try:
            await asyncio.wait({call, keeper.lost}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            await _wind_down(call)
            return _ended(call, interrupted=True)
        if call.done():
            return _ended(call)
        reason = keeper.lost.result()
        activity.logger.warning("lease may be lost (%s): cancelling the tool call", reason)
        interrupted = await _wind_down(call)
        # The call may have completed just as it was cancelled: the lease was
        # in doubt all the same, so its outcome is unknown.
        return _ended(call, lease_lost=reason, interrupted=interrupted)
    finally:
        if call.done():
            keeper.stop(keeping)
        else:  # abandoned: keep its lease held in the background until it ends
            guard = asyncio.ensure_future(_guard(call, keeper, keeping))
            _GUARDS.add(guard)
            guard.add_done_callback(_GUARDS.discard)
