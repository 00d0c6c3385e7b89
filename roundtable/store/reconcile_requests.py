"""A reconciliation request is answered once, and only as its own.

Every operator's reconciliation names its request (``request_id``, which the
server's attestation covers). Its answer is kept in the run's audit log under
a key of the action and the request: the reconciliation itself
(``action.reconciled``) or, when it was refused because the action's attempt
could still be running, that refusal (``action.reconcile_refused``). So:

* an attempt at a request that committed but whose answer was lost (the
  connection dropped after COMMIT, the activity retried) finds its own record
  and is answered with it, never as a conflict;
* a request refused for time is not taken later, when whoever copied it out
  of a history sends it again once the lease has run out: it was answered;
* an operator is never told another's reconciliation is theirs because both
  asked for the same outcome: the record names its request, not its outcome.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from roundtable.store.decision import request_dedupe_key
from roundtable.store.errors import ConflictError
from roundtable.store.schema import AuditEventRow

RECONCILED = "action.reconciled"
REFUSED = "action.reconcile_refused"
# An answer as kept: its event's type and payload.
Answer = tuple[str, dict[str, Any]]


def reconcile_key(action_id: str, request_id: str | None) -> str | None:
    """The audit key a request's answer is kept under (None: no request named)."""
    return request_dedupe_key("action.reconcile", action_id, request_id)


async def request_answer(session: AsyncSession, run_id: str, key: str | None) -> Answer | None:
    """``(event type, payload)`` of the answer kept under ``key``, if any."""
    if key is None:
        return None
    hit = await session.execute(
        select(AuditEventRow.event_type, AuditEventRow.payload).where(
            AuditEventRow.run_id == run_id, AuditEventRow.dedupe_key == key
        )
    )
    row = hit.one_or_none()
    return (row[0], row[1]) if row is not None else None


def is_own_reconciliation(answer: Answer | None, decided_by: str, outcome: str) -> bool:
    """Is this answer the request's reconciliation, to ``outcome``, made
    for ``decided_by``? (A copy whose outcome was changed is not it.)"""
    if answer is None:
        return False
    event, said = answer
    return event == RECONCILED and (said.get("decided_by"), said.get("outcome")) == (
        decided_by,
        outcome,
    )


def refuse_refused(answer: Answer | None, action_id: str) -> None:
    """A request refused before stays refused: it is never taken later."""
    if answer is not None and answer[0] == REFUSED:
        raise ConflictError(
            f"this reconciliation request of action {action_id!r} was refused at "
            f"{answer[1].get('refused_at')} (its attempt could still be running) and is not "
            "taken later: reconcile again, as a new request"
        )


def refuse_answered(answer: Answer, action_id: str, outcome: str, decided_by: str) -> None:
    """A request already answered is never applied again: a refusal stays a
    refusal, and a reconciliation is taken as this call's only when it is the
    same person's and outcome (the caller then answers with the action as it
    stands)."""
    refuse_refused(answer, action_id)
    said = answer[1]
    if said.get("decided_by") != decided_by or said.get("outcome") != outcome:
        raise ConflictError(
            "this reconciliation request was recorded for another person or outcome: "
            "it is not applied again"
        )


def refuse_late(not_after: datetime | None, now: datetime, action_id: str) -> None:
    """A request past its ``not_after`` (the database's clock) is not taken:
    its sender stopped waiting then, and told the operator nothing was
    recorded (operations.reconcile)."""
    if not_after is not None and now > not_after:
        raise ConflictError(
            f"this reconciliation request of action {action_id!r} could be recorded until "
            f"{not_after.isoformat()}, and no worker took it by then: nothing was recorded; "
            "reconcile again, as a new request"
        )


def refusal_payload(
    action_id: str, outcome: str, decided_by: str, retry_at: datetime, now: datetime
) -> dict[str, Any]:
    return {
        "action_id": action_id,
        "outcome": outcome,
        "decided_by": decided_by,
        "refused_at": now.isoformat(),
        "retry_at": retry_at.isoformat(),
    }
