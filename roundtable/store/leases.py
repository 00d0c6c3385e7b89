"""The lease protocol, in one module as the Spin model (proofs/lease.pml) has
it: claiming a target, holding the lease while the call runs, recording the
result, recovering a lapsed lease. (Over 400 lines on purpose: these steps
are one protocol and are read together.)

The rules (docs/architecture.md, "Safety rules"):
- the lease row's primary key (the target key) admits one holder per target;
- a target with an ``unknown`` action (or an overlapping one, within its
  scope) stays blocked until an operator reconciles it;
- fencing tokens grow per target *and* per scope, so a namespace-wide write
  outranks the per-key writes before it;
- a lease is removed only by a definite result or an operator's reconciliation,
  never by expiry, so clock trouble costs liveness, never safety;
- a lease that expired while its action was executing makes the action
  ``unknown``, and the target stays blocked until reconciled;
- nothing here ever re-executes anything.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import cache
from types import SimpleNamespace
from typing import Any

from sqlalchemy import (
    BigInteger,
    DateTime,
    Interval,
    and_,
    bindparam,
    func,
    insert,
    literal,
    not_,
    or_,
    select,
    true,
    update,
)
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

from roundtable import chaos_hook
from roundtable.completion import complete_every_public_coroutine
from roundtable.states import (
    FINAL_ACTION_STATUSES,
    LEASE_EXPIRED_ERROR_CODE,
    TERMINAL_RESULT_STATUSES,
    ActionStatus,
    ClaimOutcome,
)
from roundtable.store import commit_notes
from roundtable.store.audit import chained_event
from roundtable.store.core_statements import CoreConnection
from roundtable.store.core_writes import write_later
from roundtable.store.database import Database, reload
from roundtable.store.engine import (
    database_now,
    database_now_under_write_lock,
    is_postgresql,
)
from roundtable.store.errors import ConflictError, InvalidInputError, NotFoundError
from roundtable.store.outcome import (
    outcome_payload,
    record_outcome_on_connection,
    stop_lease_clock,
)
from roundtable.store.rows import require_aware, row_to_dict
from roundtable.store.schema import (
    ActionLeaseRow,
    ActionRow,
    ActionSecretRow,
    AuditEventRow,
    RunRow,
    TargetFencingRow,
    TargetScopeRow,
)

MAX_LEASE_SECONDS = 24 * 3600


def _lease_length(lease_seconds: float) -> timedelta:
    if isinstance(lease_seconds, bool) or not isinstance(lease_seconds, int | float):
        raise InvalidInputError("lease_seconds must be a number")
    if not 0 < lease_seconds <= MAX_LEASE_SECONDS:
        raise InvalidInputError(f"lease_seconds must be in (0, {MAX_LEASE_SECONDS}]")
    return timedelta(seconds=lease_seconds)


@dataclass(frozen=True)
class Claim:
    """How a claim ended; when it claimed, the action and its sealed arguments."""

    outcome: ClaimOutcome
    action: dict[str, Any] | None = None
    sealed_arguments: str | None = None


@complete_every_public_coroutine
class Leases:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def claim(self, action_id: str, lease_seconds: float) -> ClaimOutcome:
        """Try to start executing an approved action; see :class:`ClaimOutcome`."""
        return (await self._claim(action_id, lease_seconds, hand_over=False)).outcome

    async def claim_for_execution(self, action_id: str, lease_seconds: float) -> Claim:
        """:meth:`claim`, and when it claims, what the executor needs next,
        read in the claim's own transaction: the action as it now stands
        (executing, with its fencing token) and its sealed arguments."""
        return await self._claim(action_id, lease_seconds, hand_over=True)

    async def _claim(self, action_id: str, lease_seconds: float, hand_over: bool) -> Claim:
        """The claim in few statements (docs/architecture.md, "The claim"):
        the locks, one read of every fact the decision needs, the writes.
        PostgreSQL: two statements, the locks (run, scope, target counter)
        and one data-modifying CTE that checks and writes. SQLite (BEGIN
        IMMEDIATE's write lock serialises claimers): one read, then one
        statement per table written. Both on a Core connection (the ORM
        session around them cost more than they did). An action found
        ``executing`` already (a redelivered attempt, or a lapsed one) is
        settled in a transaction of its own, under the run lock."""
        length = _lease_length(lease_seconds)
        async with self.db.core_transaction() as (connection, notes):
            if is_postgresql(connection):
                facts, executing = await _claim_postgresql(connection, action_id, length)
            else:
                facts, executing = await _claim_sqlite(connection, action_id, length)
            outcome = _claim_outcome(facts, executing is not None)
            if outcome == ClaimOutcome.TARGET_BUSY or (
                outcome == ClaimOutcome.TARGET_RECONCILIATION_REQUIRED and facts.blocked_by_unknown
            ):
                notes.append(commit_notes.LeaseBusy(facts.tool_name))
        if outcome is None:
            return Claim(await self._settle_executing(action_id))
        if outcome != ClaimOutcome.CLAIMED or not hand_over:
            return Claim(outcome)
        return Claim(outcome, executing, facts.sealed)

    async def _settle_executing(self, action_id: str) -> ClaimOutcome:
        """The claim found the action executing (the claim wrote nothing).
        Under the run lock, in a transaction of its own, it is read again: an
        attempt whose lease is live is in progress; one whose lease lapsed is
        unknown; one that has since ended (its result recorded between the two
        transactions) is claimed no more, and its own status is the answer."""
        async with self.db.transaction() as session:
            run, action, now = await self.db.lock_row_and_clock(session, ActionRow, action_id)
            if action.status in FINAL_ACTION_STATUSES:
                return ClaimOutcome.ALREADY_FINISHED
            if action.status == ActionStatus.UNKNOWN:
                return ClaimOutcome.UNKNOWN
            if action.status != ActionStatus.EXECUTING:  # executing never goes back
                raise ConflictError(f"action {action_id!r} changed while being claimed")
            return await self._claim_own_executing(session, run, action, now)

    async def waiting_on_target(self, action: Mapping[str, Any], limit: int = 3) -> list[str]:
        """The runs with an approved write waiting for ``action``'s target (or
        one that may overlap it): whom to wake when it frees. The ``limit``
        longest waiting, so waiters go roughly in turn, and twenty waiters on
        a hot target do not all claim at every release (a few, in case one
        cannot act; the rest keep their timers). A superset is harmless: a
        woken write that still finds the target taken waits again. ``action``
        is the caller's copy of the row (its target does not change): one
        query, on the write path."""
        scoped = action["target_scope"] is not None
        statement = _waiting_statement(
            scoped, scoped and bool(action["target_namespace_wide"]), limit
        )
        params = {_P.target_key.key: action["target_key"], _P.action_id.key: action["id"]}
        if scoped:
            params[_P.scope.key] = action["target_scope"]
        async with self.db.core_reader(alone=True) as connection:
            return list((await connection.execute(statement, params)).scalars())

    async def _claim_own_executing(
        self, session: AsyncSession, run: RunRow, action: ActionRow, now: datetime
    ) -> ClaimOutcome:
        lease = await lease_of(session, action.id)
        if lease is not None and lease.lease_expires_at > now:
            return ClaimOutcome.IN_PROGRESS
        # Our own lease ran out mid-execution: nobody can know what happened.
        await self.mark_unknown(session, run, action, lease, now)
        return ClaimOutcome.UNKNOWN

    async def mark_unknown(
        self,
        session: AsyncSession,
        run: RunRow,
        action: ActionRow,
        lease: ActionLeaseRow | None,
        now: datetime,
        error_code: str = LEASE_EXPIRED_ERROR_CODE,
    ) -> bool:
        """executing → unknown because the lease lapsed (or the workflow closed
        under it); the lease row stays, blocking the target."""
        result = {"error_code": error_code}
        changed = await self.db.move_action(
            session,
            action.id,
            (ActionStatus.EXECUTING,),
            {
                "status": ActionStatus.UNKNOWN,
                "result": result,
                "finished_at": now,
                "updated_at": now,
            },
        )
        if changed:
            await self.db.audit(
                session,
                run,
                "action.unknown",
                {
                    "action_id": action.id,
                    "fencing_token": lease.fencing_token if lease else action.fencing_token,
                    "error_code": error_code,
                },
                now,
            )
        return changed

    async def renew(self, action_id: str, fencing_token: int, lease_seconds: float) -> bool:
        """Extend a live lease held under ``fencing_token`` of an ``executing``
        action. An expired lease is not renewed: once it lapsed, the action's
        outcome is already in doubt."""
        held = await self._extend_lease(
            action_id, fencing_token, lease_seconds, (ActionStatus.EXECUTING,)
        )
        return held is not None

    async def hold(self, action_id: str, fencing_token: int, lease_seconds: float) -> str | None:
        """What an attempt that is still running does: extend its live lease,
        whether its action is still ``executing`` or was meanwhile made
        ``unknown`` by someone else (its call may still be under way, so the
        target stays held and reconciliation refused). Returns the action's
        status, or None when the lease is lost (lapsed, gone, another token)."""
        return await self._extend_lease(
            action_id,
            fencing_token,
            lease_seconds,
            (ActionStatus.EXECUTING, ActionStatus.UNKNOWN),
        )

    async def _extend_lease(
        self, action_id: str, fencing_token: int, lease_seconds: float, statuses: tuple
    ) -> str | None:
        length = _lease_length(lease_seconds)
        params: dict[str, Any] = {_P.action_id.key: action_id, _P.token.key: fencing_token}
        async with self.db.core_transaction() as (connection, _):
            # One statement: the lease is extended only while it is live,
            # held under this token, and its action in one of ``statuses``;
            # the action's status comes back with it. The clock is read by
            # the statement itself on PostgreSQL, after any wait for the
            # lease row: a lease that lapsed meanwhile is not held.
            on_postgresql = is_postgresql(connection)
            if on_postgresql:
                params["lease_length"] = length
            else:  # SQLite: this process's clock, under the lock
                now = await database_now_under_write_lock(connection)
                params.update(lease_now=now, lease_until=now + length)
            statement = _extend_statement(on_postgresql, statuses)
            held = (await connection.execute(statement, params)).scalar_one_or_none()
            # Test-only (chaos harness; inert unless ROUNDTABLE_CHAOS=1): the
            # database fails before this renewal commits.
            chaos_hook.maybe_fail("renew")
            return held

    async def record_result(
        self,
        action_id: str,
        status: str,
        result: dict[str, Any] | None = None,
        *,
        fencing_token: int | None = None,
        external_object_id: str | None = None,
        attempt_over: bool = False,
    ) -> bool:
        """Record how an execution ended. Only an ``executing`` action changes
        (False otherwise, e.g. recovery already made it ``unknown``). A definite
        result frees the target; ``unknown`` keeps it blocked.

        ``attempt_over``: the executing attempt itself records this, after its
        tool call returned or was cancelled to the end, so nothing of it can
        still be running: the lease's clock stops and the action may be
        reconciled at once. Anyone else (the workflow after the activity
        failed) leaves the lease to run out first. (One transaction whose
        branches are read together: hence its length.)"""
        if status not in TERMINAL_RESULT_STATUSES:
            raise InvalidInputError("status must be succeeded, failed or unknown")
        if result is not None and not isinstance(result, dict):
            raise InvalidInputError("result must be a JSON object")
        async with self.db.core_transaction() as (connection, notes):
            recorded = await record_outcome_on_connection(
                connection,
                notes,
                action_id,
                status,
                result,
                fencing_token,
                external_object_id,
                attempt_over,
            )
        if recorded is not None:
            return recorded
        return await self._report_on_unknown(action_id, status, result, fencing_token, attempt_over)

    async def _report_on_unknown(
        self,
        action_id: str,
        status: str,
        result: dict[str, Any] | None,
        fencing_token: int | None,
        attempt_over: bool,
    ) -> bool:
        """The action was found ``unknown``: someone made it so while the
        attempt ran (a timeout, a closed run). What the attempt then saw is
        kept as evidence for whoever reconciles it; the status stays unknown.
        Checked again under the run lock: an unknown action never goes back
        to executing, but it may have been reconciled meanwhile."""
        async with self.db.transaction() as session:
            run, action, _ = await self.db.lock_row_and_clock(session, ActionRow, action_id)
            if fencing_token is not None and action.fencing_token != fencing_token:
                return False
            if action.status != ActionStatus.UNKNOWN:
                return False
            await self._attempt_reported(session, run, action, status, result)
            if attempt_over:  # and it has ended: no need to wait out the lease
                await self._end_attempt(session, run, action)
        return False

    async def _attempt_reported(
        self,
        session: AsyncSession,
        run: RunRow,
        action: ActionRow,
        status: str,
        result: dict[str, Any] | None,
    ) -> None:
        now = await database_now(session)
        action.result = {
            **(action.result or {}),
            "attempt_reported": {
                "status": status,
                **({"result": result} if result is not None else {}),
            },
        }
        action.updated_at = now
        payload = {**outcome_payload(action.id, action.fencing_token, result), "status": status}
        await self.db.audit(session, run, "action.attempt_reported", payload, now)

    async def _end_attempt(
        self, session: AsyncSession, run: RunRow, action: ActionRow, audit: bool = True
    ) -> None:
        """The executing attempt has ended: stop its lease's clock. The row
        stays (the target remains blocked until reconciled)."""
        now = await database_now(session)
        stop = {"stop_action_id": action.id, "token": action.fencing_token, "now": now}
        ended = await session.execute(stop_lease_clock(), stop)
        if audit and ended.rowcount:
            await self.db.audit(
                session,
                run,
                "action.attempt_ended",
                {"action_id": action.id, "fencing_token": action.fencing_token},
                now,
            )

    async def recover_expired(
        self, run_id: str | None = None, now: datetime | None = None
    ) -> list[dict[str, Any]]:
        """Turn every executing action whose lease expired at or before ``now``
        (default: the database clock) into ``unknown``. Never re-executes; the
        targets stay blocked. Returns the actions it changed."""
        if now is not None:
            require_aware("now", now)

        def due(cutoff: datetime) -> Any:
            query = (
                select(ActionLeaseRow.action_id)
                .join(ActionRow, ActionRow.id == ActionLeaseRow.action_id)
                .where(
                    ActionRow.status == ActionStatus.EXECUTING,
                    ActionLeaseRow.lease_expires_at <= cutoff,
                )
            )
            return query if run_id is None else query.where(ActionLeaseRow.run_id == run_id)

        async def settle(session: AsyncSession, action_id: str) -> dict[str, Any] | None:
            run, action = await self.db.lock_row(session, ActionRow, action_id)
            lease = await lease_of(session, action_id)
            db_clock = await database_now(session)
            if lease is None or lease.lease_expires_at > (now or db_clock):
                return None  # renewed meanwhile
            if not await self.mark_unknown(session, run, action, lease, db_clock):
                return None
            await session.flush()
            return row_to_dict(await reload(session, ActionRow, action_id))

        return await self.db.sweep(due, settle, now)

    async def live_action_ids(self) -> set[str]:
        """The actions whose lease has not run out by the database's clock."""
        async with self.db.reader() as session:
            now = await database_now(session)
            rows = await session.execute(
                select(ActionLeaseRow.action_id).where(ActionLeaseRow.lease_expires_at > now)
            )
            return set(rows.scalars())


# ----------------------------------------------------------- claiming a target


async def lease_of(session: AsyncSession, action_id: str) -> ActionLeaseRow | None:
    return (
        await session.execute(
            select(ActionLeaseRow)
            .where(ActionLeaseRow.action_id == action_id)
            .execution_options(populate_existing=True)
        )
    ).scalar_one_or_none()


@dataclass(frozen=True)
class _Facts:
    """What a claim decides on, read in one statement (see _facts_query)."""

    status: str
    tool_name: str
    blocked_by_unknown: bool  # an unknown action on the target or overlapping it
    overlap_held: bool  # a lease on an overlapping target (same scope, one of them wide)
    overlap_unknown: bool  # … whose action is unknown
    key_held: bool  # a lease on the target itself
    key_unknown: bool  # … whose action is unknown
    sealed: str | None  # the action's sealed arguments

    @classmethod
    def of(cls, row: Any) -> _Facts:
        values = row._mapping
        return cls(
            status=values["status"],
            tool_name=values["tool_name"],
            blocked_by_unknown=bool(values["blocked_by_unknown"]),
            overlap_held=bool(values["overlap_held"]),
            overlap_unknown=bool(values["overlap_unknown"]),
            key_held=bool(values["key_held"]),
            key_unknown=bool(values["key_unknown"]),
            sealed=values["sealed"],
        )

    @property
    def may_claim(self) -> bool:
        """Nothing but a holder of the key itself can stand in the way (on
        PostgreSQL the lease insert's ON CONFLICT arbitrates it; on SQLite
        the read, under the write lock, sees it)."""
        return (
            self.status == ActionStatus.APPROVED
            and not self.blocked_by_unknown
            and not self.overlap_held
        )


@dataclass(frozen=True)
class _Grant:
    """A claim's values, fixed before its writes: the lease, the token, and
    the audit event chained to the run's head; bound to the statements
    below as :meth:`params`."""

    action_id: str
    run_id: str
    target_key: str
    scope: str | None
    namespace_wide: bool
    token: int
    now: datetime
    expires: datetime
    event: dict[str, Any]

    @classmethod
    def of(
        cls,
        action_id: str,
        head: Mapping[str, Any],
        target_last: int | None,
        scope_claims: int | None,
        now: datetime,
        length: timedelta,
    ) -> _Grant:
        token = _next_fencing_token(target_last, scope_claims)
        expires = now + length
        event = chained_event(
            head["run_id"],
            head["last_event_seq"],
            head["last_event_hash"],
            EXECUTING_EVENT,
            {
                "action_id": action_id,
                "fencing_token": token,
                "lease_expires_at": expires.isoformat(),
            },
            now,
        )
        return cls(
            action_id,
            head["run_id"],
            head["target_key"],
            head["target_scope"],
            bool(head["target_namespace_wide"]),
            token,
            now,
            expires,
            event,
        )

    def params(self) -> dict[str, Any]:
        # Named unlike any column: a parameter named as a column of a table a
        # DML statement writes would be taken for a value of that column.
        return {
            "claim_action_id": self.action_id,
            "claim_run_id": self.run_id,
            "claim_target_key": self.target_key,
            "claim_scope": self.scope,
            "claim_wide": self.namespace_wide,
            "claim_token": self.token,
            "claim_now": self.now,
            "claim_expires": self.expires,
            "claim_seq": self.event["seq"],
            "claim_payload": self.event["payload"],
            "claim_prev_hash": self.event["prev_hash"],
            "claim_hash": self.event["hash"],
        }


EXECUTING_EVENT = "action.executing"


def _next_fencing_token(target_last: int | None, scope_claims: int | None) -> int:
    """The claim's fencing token: larger than every token given before on
    this target *and* in its scope, so a namespace-wide write outranks the
    per-key writes before it (and they it). The target's counter may have run
    ahead of its scope's for keys claimed before scopes existed: one past the
    larger of the two. Both counters are read under the claim's locks and are
    only ever changed by claims holding them."""
    return max(target_last or 0, scope_claims or 0) + 1


def _claim_outcome(facts: _Facts, claimed: bool) -> ClaimOutcome | None:
    """How the claim ended; None when the action is executing already (the
    caller looks at its lease). The checks in the order the protocol has
    them: the action's own state, an unknown write on the target, an
    overlapping holder, a holder of the key itself."""
    if facts.status in FINAL_ACTION_STATUSES:
        return ClaimOutcome.ALREADY_FINISHED
    if facts.status == ActionStatus.UNKNOWN:
        return ClaimOutcome.UNKNOWN
    if facts.status == ActionStatus.WAITING_APPROVAL:
        return ClaimOutcome.NOT_APPROVED
    if facts.status == ActionStatus.EXECUTING:
        return None
    if claimed:
        return ClaimOutcome.CLAIMED
    if facts.blocked_by_unknown:
        return ClaimOutcome.TARGET_RECONCILIATION_REQUIRED
    if facts.overlap_held:
        if facts.overlap_unknown:
            return ClaimOutcome.TARGET_RECONCILIATION_REQUIRED
        return ClaimOutcome.TARGET_BUSY
    if facts.key_unknown:
        return ClaimOutcome.TARGET_RECONCILIATION_REQUIRED
    return ClaimOutcome.TARGET_BUSY


# The claim's statements are built once (their construction cost more than
# their execution) over these tables and parameters.
_ACTIONS = ActionRow.__table__
_LEASES = ActionLeaseRow.__table__
_FENCING = TargetFencingRow.__table__
_SCOPES = TargetScopeRow.__table__
_EVENTS = AuditEventRow.__table__
_RUNS = RunRow.__table__
_SECRETS = ActionSecretRow.__table__
_P = SimpleNamespace(
    action_id=bindparam("claim_action_id", type_=_ACTIONS.c.id.type),
    run_id=bindparam("claim_run_id", type_=_RUNS.c.id.type),
    target_key=bindparam("claim_target_key", type_=_LEASES.c.target_key.type),
    scope=bindparam("claim_scope", type_=_LEASES.c.scope_key.type),
    wide=bindparam("claim_wide", type_=_LEASES.c.namespace_wide.type),
    token=bindparam("claim_token", type_=_LEASES.c.fencing_token.type),
    now=bindparam("claim_now", type_=_LEASES.c.acquired_at.type),
    expires=bindparam("claim_expires", type_=_LEASES.c.lease_expires_at.type),
    seq=bindparam("claim_seq", type_=_EVENTS.c.seq.type),
    payload=bindparam("claim_payload", type_=_EVENTS.c.payload.type),
    prev_hash=bindparam("claim_prev_hash", type_=_EVENTS.c.prev_hash.type),
    hash=bindparam("claim_hash", type_=_EVENTS.c.hash.type),
)
# The lease, the executing action, the event and the run's head, as a grant sets them.
_LEASE_VALUES = {
    "target_key": _P.target_key,
    "action_id": _P.action_id,
    "run_id": _P.run_id,
    "fencing_token": _P.token,
    "acquired_at": _P.now,
    "lease_expires_at": _P.expires,
    "scope_key": _P.scope,
    "namespace_wide": _P.wide,
}
_EXECUTING_VALUES = {
    "status": bindparam(
        "claim_executing", ActionStatus.EXECUTING.value, type_=_ACTIONS.c.status.type
    ),
    "fencing_token": _P.token,
    "attempt_count": _ACTIONS.c.attempt_count + 1,
    "started_at": _P.now,
    "updated_at": _P.now,
}
_EVENT_VALUES = {
    "run_id": _P.run_id,
    "seq": _P.seq,
    "event_type": bindparam("claim_event_type", EXECUTING_EVENT, type_=_EVENTS.c.event_type.type),
    "payload": _P.payload,
    "prev_hash": _P.prev_hash,
    "hash": _P.hash,
    "created_at": _P.now,
}
_HEAD_VALUES = {"last_event_seq": _P.seq, "last_event_hash": _P.hash, "updated_at": _P.now}


@cache
def _waiting_statement(scoped: bool, wide: bool, limit: int) -> Any:
    """The ``limit`` runs longest waiting with an approved write on a target
    (``claim_target_key``) or, within its scope (``claim_scope``), one that
    may overlap it (one of the two namespace-wide), the action itself
    (``claim_action_id``) left out; built once per shape (a target with no
    scope overlaps nothing but its own key)."""
    me = _ACTIONS.c
    same_or_overlapping = me.target_key == _P.target_key
    if scoped:
        overlap = me.target_scope == _P.scope
        if not wide:
            overlap = and_(overlap, me.target_namespace_wide.is_(True))
        same_or_overlapping = or_(same_or_overlapping, overlap)
    return (
        select(me.run_id)
        .where(
            same_or_overlapping,
            me.status == ActionStatus.APPROVED.value,
            me.id != _P.action_id,
        )
        .group_by(me.run_id)
        .order_by(func.min(me.created_at))
        .limit(limit)
    )


@cache
def _extend_statement(on_postgresql: bool, statuses: tuple[str, ...]) -> Any:
    """A lease's hold or renewal: ``UPDATE action_leases SET lease_expires_at
    = <clock> + :lease_length WHERE action_id = :claim_action_id AND
    fencing_token = :claim_token AND lease_expires_at > <clock> AND <the
    action's status> IN statuses RETURNING <the action's status>``. The clock
    is PostgreSQL's ``clock_timestamp()``, read where the statement uses it;
    on SQLite, the caller's, passed as ``lease_now`` and ``lease_until``."""
    status = select(_ACTIONS.c.status).where(_ACTIONS.c.id == _P.action_id).scalar_subquery()
    if on_postgresql:
        now: Any = func.clock_timestamp()
        until: Any = now + bindparam("lease_length", type_=Interval())
    else:
        now = bindparam("lease_now", type_=_LEASES.c.lease_expires_at.type)
        until = bindparam("lease_until", type_=_LEASES.c.lease_expires_at.type)
    return (
        update(_LEASES)
        .where(
            _LEASES.c.action_id == _P.action_id,
            _LEASES.c.fencing_token == _P.token,
            _LEASES.c.lease_expires_at > now,
            status.in_(statuses),
        )
        .values(lease_expires_at=until)
        .returning(status)
    )


def _overlapping(scope_column: Any, wide_column: Any) -> Any:
    """SQL condition: a row of the claimed action's scope (the ``actions``
    row of the enclosing query) whose target may overlap it: one of the two
    is namespace-wide."""
    me = _ACTIONS.c
    return and_(
        me.target_scope.is_not(None),
        scope_column == me.target_scope,
        or_(me.target_namespace_wide.is_(True), wide_column.is_(True)),
    )


@cache
def _facts_query(with_counters: bool) -> Any:
    """One SELECT of every fact a claim decides on (see :class:`_Facts`);
    ``with_counters`` adds the run's chain head and the target's and scope's
    counters (SQLite, where the write lock makes them stable)."""
    me = _ACTIONS.c
    other = _ACTIONS.alias("other")
    holder = _ACTIONS.alias("holder")
    lease = _LEASES.alias("lease")

    def held(where: Any, unknown_only: bool = False) -> Any:
        query = select(lease.c.target_key).join(holder, holder.c.id == lease.c.action_id)
        query = query.where(where)
        if unknown_only:
            query = query.where(holder.c.status == ActionStatus.UNKNOWN.value)
        return query.exists()

    overlapping = _overlapping(lease.c.scope_key, lease.c.namespace_wide)
    same_key = lease.c.target_key == me.target_key
    blocker = (
        select(other.c.id)
        .where(
            or_(
                other.c.target_key == me.target_key,
                _overlapping(other.c.target_scope, other.c.target_namespace_wide),
            ),
            other.c.status == ActionStatus.UNKNOWN.value,
            other.c.id != me.id,
        )
        .exists()
    )
    sealed = (
        select(_SECRETS.c.arguments_encrypted)
        .where(_SECRETS.c.action_id == me.id)
        .scalar_subquery()
    )
    columns = [
        me.run_id,
        me.status,
        me.tool_name,
        me.target_key,
        me.target_scope,
        me.target_namespace_wide,
        blocker.label("blocked_by_unknown"),
        held(overlapping).label("overlap_held"),
        held(overlapping, unknown_only=True).label("overlap_unknown"),
        held(same_key).label("key_held"),
        held(same_key, unknown_only=True).label("key_unknown"),
        sealed.label("sealed"),
    ]
    if not with_counters:
        return select(*columns).where(me.id == _P.action_id)
    target_last = (
        select(_FENCING.c.last_token)
        .where(_FENCING.c.target_key == me.target_key)
        .scalar_subquery()
    )
    scope_claims = (
        select(_SCOPES.c.claims).where(_SCOPES.c.scope_key == me.target_scope).scalar_subquery()
    )
    return (
        select(
            *columns,
            _RUNS.c.last_event_seq,
            _RUNS.c.last_event_hash,
            target_last.label("target_last"),
            scope_claims.label("scope_claims"),
        )
        .join(_RUNS, _RUNS.c.id == me.run_id)
        .where(me.id == _P.action_id)
    )


def _executing_dict(values: Mapping[Any, Any], prefix: str = "") -> dict[str, Any]:
    return {c.key: values[f"{prefix}{c.name}"] for c in _ACTIONS.columns}


# ----------------------------------------------------------- SQLite


async def _claim_sqlite(
    connection: CoreConnection, action_id: str, length: timedelta
) -> tuple[_Facts, dict[str, Any] | None]:
    """BEGIN IMMEDIATE (the transaction's) holds SQLite's write lock: every
    claimer, in every process, waits for it, so what the one read finds stays
    true until commit. Then one statement per table the claim writes (SQLite
    has no data-modifying CTEs): the lease, the target's and the scope's
    counters, the audit event, the run's chain head, all sent in the trip of
    the last, the action's move to executing. Three trips in all: BEGIN with
    the read, the writes, the commit.

    None of the writes needs an answer but the action's (its RETURNING is the
    executing row, and an empty one the check that it was still approved):
    the lease is a plain INSERT, so a lease the read did not see (impossible
    under the write lock) fails the claim with the database's IntegrityError,
    as any write that collides does, and the transaction keeps nothing."""
    row = (
        await connection.execute(_facts_query(with_counters=True), {"claim_action_id": action_id})
    ).one_or_none()
    if row is None:
        raise NotFoundError(f"action {action_id!r} not found")
    facts = _Facts.of(row)
    if not facts.may_claim or facts.key_held:
        return facts, None
    values = row._mapping
    grant = _Grant.of(
        action_id,
        values,
        values["target_last"],
        values["scope_claims"],
        datetime.now(UTC),  # SQLite: this process's clock (engine.database_now)
        length,
    )
    params = grant.params()
    lease, counter, scope, executing, event, head = _sqlite_writes()
    # Left for the action's move, and sent in its trip (core_writes.write_later).
    await write_later(connection, lease, params)
    await write_later(connection, counter, params)
    if grant.scope is not None:
        await write_later(connection, scope, params)
    await write_later(connection, event, params)
    await write_later(connection, head, params)
    started = (await connection.execute(executing, params)).one_or_none()
    if started is None:  # impossible under the write lock; refuse rather than guess
        raise ConflictError(f"action {action_id!r} changed while being claimed")
    return facts, _executing_dict(started._mapping)


@cache
def _sqlite_writes() -> tuple[Any, ...]:
    return (
        # No ON CONFLICT: a lease of the key already there fails the claim.
        insert(_LEASES).values(_LEASE_VALUES),
        sqlite_insert(_FENCING)
        .values(target_key=_P.target_key, last_token=_P.token)
        .on_conflict_do_update(index_elements=["target_key"], set_={"last_token": _P.token}),
        sqlite_insert(_SCOPES)
        .values(scope_key=_P.scope, claims=_P.token)
        .on_conflict_do_update(index_elements=["scope_key"], set_={"claims": _P.token}),
        update(_ACTIONS)
        .where(_ACTIONS.c.id == _P.action_id, _ACTIONS.c.status == ActionStatus.APPROVED.value)
        .values(_EXECUTING_VALUES)
        .returning(*_ACTIONS.c),
        insert(_EVENTS).values(_EVENT_VALUES),
        update(_RUNS).where(_RUNS.c.id == _P.run_id).values(_HEAD_VALUES),
    )


# ----------------------------------------------------------- PostgreSQL


async def _claim_postgresql(
    connection: AsyncConnection, action_id: str, length: timedelta
) -> tuple[_Facts, dict[str, Any] | None]:
    """Two statements. The first takes the claim's locks, in the order every
    claim takes them (the run, the scope's counter row, the target's counter
    row), and returns both counters and the clock after the last lock. The
    second, in a snapshot taken after the locks (READ COMMITTED: every
    statement has its own), checks and writes in one data-modifying CTE.

    Why the checks may read a snapshot: every claim in a scope holds the
    scope row until it commits, and every claim of a key its counter row, so
    no overlapping lease, and no lease of the key, can appear after the
    snapshot; leases that vanish after it (a result recorded) only make the
    claim refuse where it could have claimed. The lease insert's primary key
    still arbitrates the key itself (ON CONFLICT DO NOTHING)."""
    locked = (
        await connection.execute(_lock_statement(), {"claim_action_id": action_id})
    ).one_or_none()
    if locked is None:
        raise NotFoundError(f"action {action_id!r} not found")
    values = locked._mapping
    if values["isolation"] != "read committed":  # a snapshot from before the locks
        raise ConflictError(f"a claim needs READ COMMITTED, not {values['isolation']}")
    grant = _Grant.of(
        action_id,
        values,
        values["target_last"],
        values["scope_claims"],
        values["now"].astimezone(UTC),
        length,
    )
    statement = _claim_statement(scoped=grant.scope is not None)
    row = (await connection.execute(statement, grant.params())).one()
    facts = _Facts.of(row)
    executing = row._mapping["executing_id"]
    if row._mapping["leased"] is not None and executing is None:
        # Impossible under the run lock; refuse rather than guess.
        raise ConflictError(f"action {action_id!r} changed while being claimed")
    if executing is None:
        return facts, None
    return facts, _executing_dict(row._mapping, prefix="executing_")


@cache
def _lock_statement() -> Any:
    """The run's row (FOR UPDATE), then the scope's counter and the target's
    counter (each created at 0 if new, and locked by a no-op upsert, which
    returns the latest committed value whatever the snapshot), then the clock.
    Each step reads the one before it, which fixes their order."""
    run = (
        select(
            _RUNS.c.id.label("run_id"),
            _RUNS.c.last_event_seq,
            _RUNS.c.last_event_hash,
            _ACTIONS.c.target_key,
            _ACTIONS.c.target_scope,
            _ACTIONS.c.target_namespace_wide,
        )
        .select_from(_RUNS.join(_ACTIONS, _ACTIONS.c.run_id == _RUNS.c.id))
        .where(_ACTIONS.c.id == _P.action_id)
        .with_for_update(of=_RUNS)
        .cte("locked_run")
    )
    scope = (
        pg_insert(_SCOPES)
        .from_select(
            ["scope_key", "claims"],
            select(run.c.target_scope, literal(0, BigInteger())).where(
                run.c.target_scope.is_not(None)
            ),
        )
        .on_conflict_do_update(index_elements=["scope_key"], set_={"claims": _SCOPES.c.claims})
        .returning(_SCOPES.c.claims)
        .cte("locked_scope")
    )
    fence = (
        pg_insert(_FENCING)
        .from_select(
            ["target_key", "last_token"],
            select(run.c.target_key, literal(0, BigInteger())).select_from(
                run.outerjoin(scope, true())
            ),
        )
        .on_conflict_do_update(
            index_elements=["target_key"], set_={"last_token": _FENCING.c.last_token}
        )
        .returning(
            _FENCING.c.last_token,
            func.clock_timestamp(type_=DateTime(timezone=True)).label("now"),
        )
        .cte("locked_target")
    )
    return select(
        *run.c,
        select(scope.c.claims).scalar_subquery().label("scope_claims"),
        fence.c.last_token.label("target_last"),
        fence.c.now,
        # The second statement's checks need a snapshot of their own.
        func.current_setting("transaction_isolation").label("isolation"),
    ).select_from(run.join(fence, true()))


@cache
def _claim_statement(scoped: bool) -> Any:
    """The checks and every write of the claim, as one statement: the lease
    is inserted only if the checks pass (and the key is free), every other
    write only if the lease was."""
    facts = _facts_query(with_counters=False).cte("facts")
    leased = (
        pg_insert(_LEASES)
        .from_select(
            list(_LEASE_VALUES),
            select(*_LEASE_VALUES.values()).where(
                facts.c.status == ActionStatus.APPROVED.value,
                not_(facts.c.blocked_by_unknown),
                not_(facts.c.overlap_held),
            ),
        )
        .on_conflict_do_nothing(index_elements=["target_key"])
        .returning(_LEASES.c.target_key)
        .cte("leased")
    )
    got_lease = select(leased.c.target_key).exists()
    executing = (
        update(_ACTIONS)
        .where(
            _ACTIONS.c.id == _P.action_id,
            _ACTIONS.c.status == ActionStatus.APPROVED.value,
            got_lease,
        )
        .values(_EXECUTING_VALUES)
        .returning(*_ACTIONS.c)
        .cte("executing")
    )
    started = select(executing.c.id).exists()
    writes = [
        update(_FENCING)
        .where(_FENCING.c.target_key == _P.target_key, got_lease)
        .values(last_token=_P.token)
        .returning(_FENCING.c.target_key)
        .cte("target_counted")
    ]
    if scoped:
        writes.append(
            update(_SCOPES)
            .where(_SCOPES.c.scope_key == _P.scope, got_lease)
            .values(claims=_P.token)
            .returning(_SCOPES.c.scope_key)
            .cte("scope_counted")
        )
    writes.append(
        insert(_EVENTS)
        .from_select(list(_EVENT_VALUES), select(*_EVENT_VALUES.values()).where(started))
        .returning(_EVENTS.c.id)
        .cte("audited")
    )
    writes.append(
        update(_RUNS)
        .where(_RUNS.c.id == _P.run_id, started)
        .values(_HEAD_VALUES)
        .returning(_RUNS.c.id)
        .cte("chained")
    )
    return (
        select(
            *facts.c,
            select(leased.c.target_key).scalar_subquery().label("leased"),
            *(c.label(f"executing_{c.name}") for c in executing.c),
        )
        .select_from(facts.outerjoin(executing, true()))
        .add_cte(*writes)
    )
