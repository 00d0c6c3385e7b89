"""A tool call under a target lease: it runs only while the lease is ours.

Beside the call, a keeper heartbeats to Temporal and renews the lease. The
moment the lease cannot be renewed (renewal refused, renewal failing, or its
expiry near with no successful renewal), the call is cancelled, and the keeper
goes on heartbeating until the call has really ended, so Temporal sees the
attempt end instead of timing it out. The expiry is tracked on this process's
monotonic clock from the moment each renewal was *sent*: the database set the
lease from a later instant, so our deadline falls before the database's.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from temporalio import activity

# How long a cancelled tool call may take to wind down while we keep
# heartbeating for it; a call that ignores cancellation longer is abandoned
# (and its attempt is then not known to be over).
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


Renew = Callable[[], Awaitable[bool]]


async def _heartbeat(interval: float) -> None:
    """Tell Temporal the attempt is alive, until cancelled. Separate from
    renewal: a slow database must not make a live attempt look dead."""
    while True:
        with contextlib.suppress(Exception):
            activity.heartbeat()
        await asyncio.sleep(interval)


async def _keep_lease(terms: LeaseTerms, renew: Renew) -> str:
    """Renew until the lease is lost; returns why."""
    loop = asyncio.get_running_loop()
    deadline = terms.claimed_at + terms.lease_seconds - terms.margin
    while True:
        wake = min(loop.time() + terms.heartbeat_interval_seconds, deadline)
        await asyncio.sleep(max(wake - loop.time(), 0))
        if loop.time() >= deadline:
            return "lease_expiring_unrenewed"
        sent = loop.time()
        try:
            renewed = await asyncio.wait_for(renew(), timeout=max(deadline - sent, 0.001))
        except TimeoutError:
            return "lease_renewal_timed_out"
        except Exception as exc:  # the database failed: we cannot know the lease holds
            activity.logger.warning("lease renewal failed: %s", type(exc).__name__)
            return "lease_renewal_failed"
        if not renewed:
            return "lease_renewal_refused"
        deadline = sent + terms.lease_seconds - terms.margin


async def _wind_down(call: asyncio.Task[Any]) -> None:
    """Cancel the call and wait (heartbeats go on) until it has ended, or
    until the grace runs out."""
    call.cancel()
    await asyncio.wait({call}, timeout=CANCEL_GRACE_SECONDS)


def _ended(call: asyncio.Task[Any], **how: Any) -> CallOutcome:
    if not call.done():
        return CallOutcome(finished=False, **how)
    if call.cancelled():
        return CallOutcome(error=asyncio.CancelledError(), **how)
    if call.exception() is not None:
        return CallOutcome(error=call.exception(), **how)
    return CallOutcome(result=call.result(), **how)


async def call_under_lease(
    invoke: Callable[[], Awaitable[Any]], terms: LeaseTerms, renew: Renew
) -> CallOutcome:
    """Run ``invoke()`` while the lease holds; never raises what the call
    raised (it is in the outcome). If this activity is cancelled meanwhile, the
    call is wound down first and the outcome says ``interrupted``."""
    call = asyncio.ensure_future(invoke())
    keeper = asyncio.ensure_future(_keep_lease(terms, renew))
    beating = asyncio.ensure_future(_heartbeat(terms.heartbeat_interval_seconds))
    try:
        try:
            await asyncio.wait({call, keeper}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            keeper.cancel()
            await _wind_down(call)
            return _ended(call, interrupted=True)
        if call.done():
            return _ended(call)
        reason = keeper.result()
        activity.logger.warning("lease lost (%s): cancelling the tool call", reason)
        await _wind_down(call)
        # The call may have completed just as it was cancelled: the lease was
        # lost all the same, so its outcome is unknown.
        return _ended(call, lease_lost=reason)
    finally:
        for task in (keeper, beating):
            task.cancel()
        await asyncio.wait({keeper, beating})
