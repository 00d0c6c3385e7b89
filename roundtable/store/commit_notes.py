"""What a transaction did, told to observers only once it has committed.

Metrics count terminal transitions, approval waits and busy targets. Counting inside the
transaction would count work a rollback then undid (the chaos harness fails
transactions on purpose), so the code that makes a transition notes it on the
session, and ``Database.transaction`` hands the notes on after the commit.
A rolled-back transaction's notes are dropped with its session. The claim,
on a Core connection, appends to ``Database.core_transaction``'s list instead,
handed on the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy.ext.asyncio import AsyncSession

_KEY = "roundtable.commit_notes"


@dataclass(frozen=True)
class ActionEnded:
    """An action reached ``status``: rejected, succeeded, failed or unknown.
    An unknown action later reconciled is noted twice: unknown, then its outcome."""

    tool: str
    status: str


@dataclass(frozen=True)
class ApprovalSettled:
    """An approval was decided (approved, rejected) or expired after waiting this long."""

    outcome: str
    waited_seconds: float


@dataclass(frozen=True)
class LeaseBusy:
    """A claim found its target held by another write, or blocked by an unknown one."""

    tool: str


Note = ActionEnded | ApprovalSettled | LeaseBusy
Observer = Callable[[Sequence[Note]], None]


def note(session: AsyncSession, fact: Note) -> None:
    session.info.setdefault(_KEY, []).append(fact)


def approval_settled(
    session: AsyncSession, outcome: str, requested_at: datetime, now: datetime
) -> None:
    note(session, ApprovalSettled(outcome, max(0.0, (now - requested_at).total_seconds())))


def take(session: AsyncSession) -> list[Note]:
    return session.info.pop(_KEY, [])
