"""An approval's decision as plain statements on a Core connection.

The decision is on the path of every approval: the operator's call waits for
it, and the write waits for the call. Through the ORM session it was ten
statements and about 9 ms of this process's CPU on SQLite (identity map,
re-reads, two flushes of a unit of work), for statements SQLite runs in
microseconds. Here, as the claim is (leases.py), it is what it writes: the
locks and one read of every fact the decision needs, then one statement per
row it changes. The rules are the ORM path's, each checked on the locked rows:
who may decide (``guard``), still pending, the arguments decided on, the
deadline by the database clock read after the lock.

The values each settlement writes (decided or expired) come from the
functions below, which the ORM paths (Approvals.expire, the sweep) use too.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from datetime import datetime
from functools import cache
from typing import Any

from roundtable.states import (
    APPROVAL_EXPIRED_REASON,
    ENDING_ACTION_STATUSES,
    ActionStatus,
    ApprovalStatus,
    RunStatus,
)
from roundtable.store import commit_notes
from roundtable.store.core_statements import CoreConnection
from roundtable.store.core_writes import (
    ChainedRun,
    event_logged,
    facts_read,
    locked_facts,
    update_row,
)
from roundtable.store.errors import ConflictError
from roundtable.store.run_status import carry_run_status_on
from roundtable.store.schema import ActionRow, ApprovalRow, RunRow

_APPROVALS = ApprovalRow.__table__
_ACTIONS = ActionRow.__table__
_RUNS = RunRow.__table__


def decided_values(
    decision: str, decided_by: str, reason: str | None, now: datetime
) -> dict[str, Any]:
    """The approval, as a decision leaves it."""
    return {
        "status": decision,
        "decided_by": decided_by,
        "decision_reason": reason,
        "decided_at": now,
        "updated_at": now,
    }


def action_after_decision(decision: str, now: datetime) -> dict[str, Any]:
    """The action, as a decision leaves it: approved, or rejected and ended."""
    if decision == ApprovalStatus.APPROVED:
        return {"status": ActionStatus.APPROVED, "updated_at": now}
    return {"status": ActionStatus.REJECTED, "updated_at": now, "finished_at": now}


def expired_values(now: datetime) -> dict[str, Any]:
    """The approval, as its deadline leaves it."""
    return {"status": ApprovalStatus.EXPIRED, "decided_at": now, "updated_at": now}


def action_after_expiry(now: datetime) -> dict[str, Any]:
    """The action, as its approval's deadline leaves it: rejected, ended."""
    return {
        "status": ActionStatus.REJECTED,
        "result": {"error_code": APPROVAL_EXPIRED_REASON},
        "finished_at": now,
        "updated_at": now,
    }


def decision_payload(
    approval_id: str, action_id: str, decided_by: str, reason: str | None
) -> dict[str, Any]:
    """What the decision's two audit events say."""
    return {
        "approval_id": approval_id,
        "action_id": action_id,
        "decided_by": decided_by,
        "reason": reason,
    }


def expiry_payload(approval_id: str, action_id: str) -> dict[str, Any]:
    """What the expiry's two audit events say."""
    return {"approval_id": approval_id, "action_id": action_id, "reason": APPROVAL_EXPIRED_REASON}


def request_dedupe_key(event_type: str, approval_id: str, request_key: str | None) -> str | None:
    """The audit event's dedupe key for one request's change to one approval
    (None: no request key, no dedupe). The approval is in it, so one update
    id can never stand for a change to another approval; the request key
    goes in as its SHA-256, so two long update ids (Temporal takes them up
    to 1,000 characters) never share a key cut to the column's 255."""
    if request_key is None:
        return None
    digest = hashlib.sha256(request_key.encode()).hexdigest()
    return f"{event_type}:{approval_id}:{digest}"


EDITED = "action.arguments_edited"


def change_recorded(decision: str, edited: bool) -> str:
    """The audit event a decision's request is recorded under: its edit's,
    or the plain decision's (what a request's record is looked up by)."""
    return EDITED if edited else f"approval.{decision}"


def edit_dedupe_key(approval_id: str, request_key: str | None) -> str:
    """The dedupe key of an approval's edit event: its request's
    (:func:`request_dedupe_key`), or, for an edit no request names (a
    signal's), one of the approval's own, looked up by nobody as a request's
    record. Every edit event has one, so :func:`edit_key_prefix` finds an
    approval's edit by the (run, dedupe key) index, without reading the
    run's other events."""
    return request_dedupe_key(EDITED, approval_id, request_key) or f"{EDITED}:{approval_id}:unkeyed"


def edit_key_prefix(approval_id: str) -> str:
    """What every dedupe key an approval's edit event may have begins with.
    Matched as a prefix (LIKE), not as a range of keys: how PostgreSQL orders
    ':' against ';' depends on the database's collation."""
    return f"{EDITED}:{approval_id}:"


async def decide_on_connection(
    connection: CoreConnection,
    notes: list[commit_notes.Note],
    approval_id: str,
    decision: str,
    decided_by: str,
    reason: str | None,
    arguments_digest: str | None,
    run_status: str | None,
    guard: Callable[[str, str], None] | None,
    request_key: str | None = None,
) -> dict[str, Any] | None:
    """Decide under the run lock, in the caller's transaction. Returns the
    approval as decided, with ``action_status`` and ``run_status``; None when
    the deadline had passed, in which case the approval and its action were
    expired instead (the caller commits that, then refuses the decision).
    Whatever a check raises leaves nothing written.

    ``request_key`` (the asking update's id): the decision is recorded under
    it, and a call that finds its own decision recorded (an attempt before
    committed it, and its answer was lost, or its timeout cancelled it while
    its transaction ran on) writes nothing and answers with the approval as
    it stands: the operator is told the decision stands, not that it
    conflicts with itself."""
    facts, now = await locked_facts(
        connection, _APPROVALS, approval_id, _facts_statement, "approval"
    )
    if guard is not None:
        guard(facts["user_id"], facts["risk_level"])
    key = request_dedupe_key(f"approval.{decision}", approval_id, request_key)
    if facts["status"] != ApprovalStatus.PENDING:
        if key is not None:
            recorded = await _logged(connection, facts["run_id"], key)
            if recorded is not None:
                same_actor(recorded, "decided_by", decided_by)
                return _as_it_stands(facts)
        raise ConflictError(f"approval {approval_id!r} is already {facts['status']}")
    if arguments_digest is not None and facts["arguments_digest"] != arguments_digest:
        raise ConflictError(
            "arguments_digest does not match the action's arguments; "
            "re-read the approval before deciding"
        )
    run = ChainedRun(facts["run_id"], facts["last_event_seq"], facts["last_event_hash"])
    run_now = RunStatus(facts["run_status"])
    action_id = facts["action_id"]
    if now >= facts["expires_at"]:
        outcome = ApprovalStatus.EXPIRED
        approval_values, action_values = expired_values(now), action_after_expiry(now)
        said = expiry_payload(approval_id, action_id)
        events = (("approval.expired", said, None), ("action.rejected", said, None))
    else:
        outcome = decision
        approval_values = decided_values(decision, decided_by, reason, now)
        action_values = action_after_decision(decision, now)
        said = decision_payload(approval_id, action_id, decided_by, reason)
        events = (
            (f"approval.{decision}", said, key),
            (f"action.{action_values['status']}", said, None),
        )
    decided = (
        await update_row(
            connection,
            _APPROVALS,
            approval_id,
            approval_values,
            ApprovalStatus.PENDING,
            returning=tuple(_APPROVALS.c.keys()),
        )
    ).one_or_none()
    if decided is None:  # impossible under the run lock; refuse rather than guess
        raise ConflictError(f"approval {approval_id!r} is no longer pending")
    notes.append(
        commit_notes.ApprovalSettled(outcome, max(0.0, (now - facts["created_at"]).total_seconds()))
    )
    tool = (
        await update_row(
            connection,
            _ACTIONS,
            action_id,
            action_values,
            ActionStatus.WAITING_APPROVAL,
            returning=("tool_name",),
        )
    ).scalar_one_or_none()
    if tool is not None and action_values["status"] in ENDING_ACTION_STATUSES:
        notes.append(commit_notes.ActionEnded(tool, str(action_values["status"])))
    for event_type, payload, dedupe_key in events:
        run.append(event_type, payload, now, dedupe_key=dedupe_key)
    if outcome != ApprovalStatus.EXPIRED:
        held = {"session_id": facts["session_id"], "failure": facts["run_failure"]}
        run_now = await carry_run_status_on(connection, run, run_now, run_status, held, now)
    await run.write(connection, now)
    if outcome == ApprovalStatus.EXPIRED:
        return None
    action_status = str(action_values["status"]) if tool is not None else facts["action_status"]
    return {**decided._asdict(), "action_status": action_status, "run_status": str(run_now)}


async def _logged(connection: CoreConnection, run_id: str, key: str) -> dict[str, Any] | None:
    seen = await connection.execute(event_logged(payload=True), {"run_id": run_id, "key": key})
    return seen.scalar_one_or_none()


def same_actor(recorded: dict[str, Any], field: str, actor: str) -> None:
    """A request's record answers only the person it recorded: one whose
    key matches but whose name does not (a key chosen to match another's,
    through Temporal directly) is refused, never told another's change is
    theirs. Not told to send it again either: the record may be the
    caller's own, made when the server's word did not verify (an extension
    is then recorded as "unattested:<name>"), and a new request would apply
    it twice."""
    if recorded.get(field) != actor:
        raise ConflictError(
            "this request was recorded for another person (or for the same one "
            "without the server's word): it is not applied again"
        )


def _as_it_stands(facts: Any) -> dict[str, Any]:
    """The approval as the locked read found it, as a decision answers it."""
    approval = {name: facts[name] for name in _APPROVALS.c.keys()}
    return {
        **approval,
        "action_status": facts["action_status"],
        "run_status": str(RunStatus(facts["run_status"])),
    }


@cache
def _facts_statement(postgresql: bool) -> Any:
    """The approval, its action and its run in one read."""
    joined = _APPROVALS.join(_ACTIONS, _ACTIONS.c.id == _APPROVALS.c.action_id).join(
        _RUNS, _RUNS.c.id == _APPROVALS.c.run_id
    )
    columns = [
        *_APPROVALS.c,
        _ACTIONS.c.status.label("action_status"),
        _ACTIONS.c.risk_level,
        _ACTIONS.c.arguments_digest,
        _RUNS.c.session_id,
        _RUNS.c.user_id,
        _RUNS.c.status.label("run_status"),
        _RUNS.c.failure.label("run_failure"),
    ]
    return facts_read(postgresql, _APPROVALS, joined, columns)
