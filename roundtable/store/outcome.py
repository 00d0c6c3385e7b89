"""A write's outcome, recorded by its own attempt, as plain statements on a
Core connection: the common case of Leases.record_result.

Every approved write ends here, on the path from the decision to the write
recorded. Through the ORM session the recording cost about 3.5 ms of this
process's CPU on SQLite (a re-read with populate_existing, the unit of work's
flush) for five statements SQLite runs in microseconds. Here: the run lock
and one read of the action and the run's chain head, then one statement per
row written. The rules are the ORM path's, on the locked rows: only the
attempt holding the action's fencing token records, only an ``executing``
action changes, a definite outcome frees the target, ``unknown`` keeps it
blocked (and, when the attempt is over, stops its lease's clock).

An action that someone else made ``unknown`` while the attempt ran is not
handled here: nothing is written and the caller takes the ORM path, which
keeps what the attempt saw as evidence (rare, and not on any hot path).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from functools import cache
from typing import Any

from sqlalchemy import bindparam, delete, update

from roundtable import chaos_hook
from roundtable.states import ENDING_ACTION_STATUSES, ActionStatus
from roundtable.store import commit_notes
from roundtable.store.core_statements import CoreConnection
from roundtable.store.core_writes import (
    ChainedRun,
    facts_read,
    locked_facts,
    update_row,
    write_later,
)
from roundtable.store.schema import ActionLeaseRow, ActionRow, RunRow
from roundtable.store.text import escape_text

_ACTIONS = ActionRow.__table__
_RUNS = RunRow.__table__
_LEASES = ActionLeaseRow.__table__


_EXTERNAL_ID_LENGTH: int = _ACTIONS.c.external_object_id.type.length


def storable_external_id(value: str) -> str:
    """The id a tool gave its object, as the column keeps it: escaped, and,
    past the column's length, cut with a digest of the whole appended, so
    two long ids stay apart (the whole id stays in the action's result).
    From the tool, so kept rather than failing the write's record: on
    PostgreSQL a longer id failed the UPDATE and lost a succeeded write
    (found by the review of this module; SQLite has no length limit)."""
    escaped = escape_text(value)
    if len(escaped) <= _EXTERNAL_ID_LENGTH:
        return escaped
    digest = "…sha256:" + hashlib.sha256(escaped.encode()).hexdigest()
    return escaped[: _EXTERNAL_ID_LENGTH - len(digest)] + digest


def outcome_payload(
    action_id: str, fencing_token: int | None, result: Mapping[str, Any] | None
) -> dict[str, Any]:
    """What the outcome's audit event says: the action, the attempt's token,
    and the error code when the result carries one."""
    payload: dict[str, Any] = {"action_id": action_id, "fencing_token": fencing_token}
    if isinstance((result or {}).get("error_code"), str):
        payload["error_code"] = result["error_code"]  # type: ignore[index]
    return payload


async def record_outcome_on_connection(
    connection: CoreConnection,
    notes: list[commit_notes.Note],
    action_id: str,
    status: str,
    result: dict[str, Any] | None,
    fencing_token: int | None,
    external_object_id: str | None,
    attempt_over: bool,
) -> bool | None:
    """Record ``status`` for an ``executing`` action, in the caller's
    transaction: True when recorded; False when it is not this attempt's to
    record (another token, or the action no longer executing); None, having
    written nothing, when the action is ``unknown`` (the caller's ORM path
    keeps the attempt's report as evidence)."""
    facts, now = await locked_facts(connection, _ACTIONS, action_id, _facts_statement, "action")
    if fencing_token is not None and facts["fencing_token"] != fencing_token:
        return False
    if facts["status"] == ActionStatus.UNKNOWN:
        return None
    if facts["status"] != ActionStatus.EXECUTING:
        return False
    values: dict[str, Any] = {
        "status": status,
        "result": result,
        "finished_at": now,
        "updated_at": now,
    }
    if external_object_id is not None:
        values["external_object_id"] = storable_external_id(external_object_id)
    tool = (
        await update_row(
            connection, _ACTIONS, action_id, values, ActionStatus.EXECUTING, ("tool_name",)
        )
    ).scalar_one_or_none()
    if tool is None:  # impossible under the run lock; record nothing rather than guess
        return False
    if status in ENDING_ACTION_STATUSES:
        notes.append(commit_notes.ActionEnded(tool, status))
    if status != ActionStatus.UNKNOWN:
        await write_later(connection, _free_target(), {"action_id": action_id})
    elif attempt_over:  # the attempt has ended: stop its lease's clock, keep the row
        stop = {"stop_action_id": action_id, "token": facts["fencing_token"], "now": now}
        await write_later(connection, stop_lease_clock(), stop)
    run = ChainedRun(facts["run_id"], facts["last_event_seq"], facts["last_event_hash"])
    run.append(f"action.{status}", outcome_payload(action_id, facts["fencing_token"], result), now)
    await run.write(connection, now)
    # Test-only (chaos harness; inert unless ROUNDTABLE_CHAOS=1): the
    # database fails before the result commits.
    chaos_hook.maybe_fail("record_result")
    return True


@cache
def _facts_statement(postgresql: bool) -> Any:
    """The action's status and token, with its run's head, in one read."""
    joined = _ACTIONS.join(_RUNS, _RUNS.c.id == _ACTIONS.c.run_id)
    columns = [_ACTIONS.c.run_id, _ACTIONS.c.status, _ACTIONS.c.fencing_token]
    return facts_read(postgresql, _ACTIONS, joined, columns)


@cache
def _free_target() -> Any:
    return delete(_LEASES).where(
        _LEASES.c.action_id == bindparam("action_id", type_=_LEASES.c.action_id.type)
    )


@cache
def stop_lease_clock() -> Any:
    """Stop the clock of the lease that ``:stop_action_id``'s attempt holds
    under ``:token``, if still running at ``:now`` (the row stays: the target
    remains blocked). Leases._end_attempt runs it too."""
    now = bindparam("now", type_=_LEASES.c.lease_expires_at.type)
    return (
        update(_LEASES)
        .where(
            _LEASES.c.action_id == bindparam("stop_action_id", type_=_LEASES.c.action_id.type),
            _LEASES.c.fencing_token == bindparam("token", type_=_LEASES.c.fencing_token.type),
            _LEASES.c.lease_expires_at > now,
        )
        .values(lease_expires_at=now)
    )
