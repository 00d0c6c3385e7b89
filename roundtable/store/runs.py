"""Runs: created with their grant, moved along their state machine, their
turns and refusals logged, settled when their workflow closes without them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import cache
from typing import TYPE_CHECKING, Any

from sqlalchemy import bindparam, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from roundtable.completion import complete_every_public_coroutine
from roundtable.states import (
    FINAL_RUN_STATUSES,
    RUN_ENDED_REASON,
    WORKFLOW_CLOSED_ERROR_CODE,
    ActionStatus,
    RunStatus,
)
from roundtable.store.audit import GENESIS_HASH
from roundtable.store.core_statements import CoreConnection
from roundtable.store.core_writes import (
    ChainedRun,
    as_written,
    insert_into,
    locked_run,
    write_later,
)
from roundtable.store.database import Database, logged
from roundtable.store.engine import database_now, dialect_insert, is_postgresql
from roundtable.store.errors import ConflictError, InvalidInputError, NotFoundError
from roundtable.store.leases import lease_of
from roundtable.store.rows import new_id, page_after, require_text
from roundtable.store.run_status import carry_run_status_on, move_run, move_run_on
from roundtable.store.schema import (
    ActionRow,
    AuditEventRow,
    CapabilitySnapshotRow,
    RunRow,
    SessionRow,
)
from roundtable.store.sessions import Sessions, check_session, insert_session
from roundtable.store.text import escape_text

if TYPE_CHECKING:
    from roundtable.store.actions import Actions
    from roundtable.store.leases import Leases


def _run_status(status: str) -> RunStatus:
    try:
        return RunStatus(status)
    except ValueError as exc:
        raise InvalidInputError(f"unknown run status {status!r}") from exc


def _failure(failure: Mapping[str, Any] | None) -> dict[str, str] | None:
    """A run's failure as stored: a short code and a bounded message, with
    what the database cannot keep escaped as the JSON column escapes it, so
    the answer is what a later read finds."""
    if failure is None:
        return None
    code, message = failure.get("code"), failure.get("message")
    if not isinstance(code, str) or not code or not isinstance(message, str):
        raise InvalidInputError("failure needs a code and a message")
    return {"code": escape_text(code[:64]), "message": escape_text(message[:2000])}


@dataclass(frozen=True)
class RunGrant:
    """What the API or CLI allowed a run when it started it (see
    roundtable/permissions.py); empty for a run the worker creates."""

    write_policy: str | None = None
    role: str | None = None
    tenants: tuple[str, ...] | None = None  # None: every tenant

    def audited(self) -> dict[str, Any]:
        if self.role is None:
            return {}
        return {
            "granted_write_policy": self.write_policy,
            "started_by_role": self.role,
            "tenants": list(self.tenants) if self.tenants is not None else None,
        }


_SESSIONS = SessionRow.__table__
_RUNS = RunRow.__table__
_SNAPSHOTS = CapabilitySnapshotRow.__table__
# What a run's log says of its recoveries (Runs.begin_recovery).
RECOVERY_EVENTS = ("run.recovery_begun", "run.recovered", "run.recovery_failed")


@cache
def _keep_snapshot(postgresql: bool) -> Any:
    """A snapshot kept under its digest, once (built once per dialect: a
    statement with its values built in was a new cache key every opening)."""
    return dialect_insert(postgresql, _SNAPSHOTS).on_conflict_do_nothing(index_elements=["digest"])


@cache
def _session_owner() -> Any:
    return select(_SESSIONS.c.user_id).where(
        _SESSIONS.c.id == bindparam("session_id", type_=_SESSIONS.c.id.type)
    )


async def _insert_run(
    connection: CoreConnection,
    run_id: str,
    session_id: str,
    user_id: str,
    request_fingerprint: str | None,
    grant: RunGrant,
    now: datetime | None = None,
) -> dict[str, Any]:
    """A new run of the session ``session_id`` with its first audit event,
    in the caller's transaction (at ``now``, the database's clock read in it
    already, if given); its row as row_to_dict gives it."""
    # The id as it is stored and hashed: text (SQLite would keep 5 as "5"
    # while the event's hash took the number).
    require_text("run_id", run_id)
    now = now or await database_now(connection)
    chain = ChainedRun(run_id, 0, GENESIS_HASH)
    chain.append("run.created", {"session_id": session_id, **grant.audited()}, now)
    row = {
        "id": run_id,
        "session_id": session_id,
        "user_id": user_id,
        "status": RunStatus.PENDING,
        "last_event_seq": chain.last_seq,
        "last_event_hash": chain.last_hash,
        "request_fingerprint": request_fingerprint,
        "granted_write_policy": grant.write_policy,
        "started_by_role": grant.role,
        "tenants": list(grant.tenants) if grant.tenants is not None else None,
        "created_at": now,
        "updated_at": now,
    }
    # The run first: its events refer to it.
    await write_later(connection, insert_into(_RUNS), row)
    await chain.write_events(connection)
    return {column.key: row.get(column.key) for column in _RUNS.c}


@complete_every_public_coroutine
class Runs:
    def __init__(self, db: Database, sessions: Sessions, actions: Actions, leases: Leases) -> None:
        self.db, self.sessions, self.actions, self.leases = db, sessions, actions, leases

    async def create(
        self,
        *,
        session_id: str,
        user_id: str,
        run_id: str | None = None,
        request_fingerprint: str | None = None,
        grant: RunGrant | None = None,
    ) -> dict[str, Any]:
        require_text("user_id", user_id)
        grant = grant or RunGrant()
        async with self.db.core_transaction() as (connection, _):
            owner = await connection.execute(_session_owner(), {"session_id": session_id})
            # Another user's session is reported as missing: ids must not leak.
            if owner.scalar_one_or_none() != user_id:
                raise NotFoundError(f"session {session_id!r} not found")
            return await _insert_run(
                connection, run_id or new_id(), session_id, user_id, request_fingerprint, grant
            )

    async def ensure(
        self,
        *,
        run_id: str,
        user_id: str,
        task_text: str,
        request_fingerprint: str | None = None,
        grant: RunGrant | None = None,
    ) -> dict[str, Any]:
        """The run with this id, created (with its session) if it does not exist yet.
        Callers that start a workflow create the run first, so it is readable at once.
        With ``request_fingerprint``, an existing run made for another request
        is a conflict (an Idempotency-Key reused for a different body)."""
        # Read with find, not get: a NotFoundError per run started would
        # keep its frames (one holding a connection) alive in a reference
        # cycle until the collector's next full pass.
        run = await self.db.find(RunRow, "id", run_id)
        if run is None:
            check_session(user_id, task_text)
            try:
                # The session and the run in one transaction: a run created
                # concurrently leaves no session of ours behind.
                async with self.db.core_transaction() as (connection, _):
                    session = await insert_session(connection, user_id, task_text)
                    return await _insert_run(
                        connection,
                        run_id,
                        session["id"],
                        user_id,
                        request_fingerprint,
                        grant or RunGrant(),
                        now=session["created_at"],
                    )
            except IntegrityError:  # created concurrently; theirs stands
                run = await self.get(run_id)
        if run["user_id"] != user_id:
            raise ConflictError(f"run {run_id!r} belongs to another user")
        known = run["request_fingerprint"]
        if request_fingerprint and known and known != request_fingerprint:
            raise ConflictError("this Idempotency-Key was already used for a different request")
        return run

    async def pin_snapshot(
        self,
        run_id: str,
        digest: str,
        status: str | None = None,
        body: str | None = None,
    ) -> str:
        """Record the capability snapshot the worker computed for the run (its
        workflow's start, or a reset to it, computes it anew); with
        ``status``, move the run there in the same transaction, as
        :meth:`set_status` would; with ``body`` (the snapshot as the JSON
        text its digest was taken of), keep it under ``digest``, once: the
        reader checks the two agree (:meth:`kept_snapshot`). Written every
        opening, not remembered as written: a row that went (a restored
        database) comes back with the next run of that snapshot. The run's
        status as the transaction left it."""
        wanted = _run_status(status).value if status is not None else None
        async with self.db.core_transaction() as (connection, _):
            held, now = await locked_run(connection, run_id)
            run = ChainedRun(held["id"], held["last_event_seq"], held["last_event_hash"])
            if body is not None:
                kept = {"digest": digest, "body": body, "kept_at": now}
                await write_later(connection, _keep_snapshot(is_postgresql(connection)), kept)
            if held["snapshot_digest"] != digest:
                run.changes["snapshot_digest"] = digest
                run.append("run.snapshot_pinned", {"snapshot_digest": digest}, now)
            # A move the state machine refuses (a reset of a run that ended,
            # say) is left to the status write that follows, which refuses it
            # as it always did; the pin stands either way. No still-waiting
            # check, unlike a write's carried status: this replaces the
            # workflow's own set_status("running"), which made none either.
            shown = await carry_run_status_on(
                connection,
                run,
                RunStatus(held["status"]),
                wanted,
                held,
                now,
                unless_waiting=False,
            )
            await run.write(connection, now)
            return str(shown)

    async def kept_snapshot(self, digest: str) -> str | None:
        """The snapshot's JSON text kept under ``digest`` by :meth:`pin_snapshot`."""
        row = await self.db.find(CapabilitySnapshotRow, "digest", digest)
        return None if row is None else row["body"]

    async def get(self, run_id: str) -> dict[str, Any]:
        return await self.db.get(RunRow, run_id)

    async def list_sessions(self, *, user_id: str | None = None) -> list[dict[str, Any]]:
        query = select(SessionRow).order_by(SessionRow.created_at, SessionRow.id)
        if user_id is not None:
            query = query.where(SessionRow.user_id == user_id)
        return await self.db.all(query)

    async def list(
        self,
        *,
        user_id: str | None = None,
        status: str | None = None,
        limit: int | None = None,
        after: tuple[datetime, str] | None = None,
    ) -> list[dict[str, Any]]:
        """Oldest first; ``after`` is the (created_at, id) of the last row seen."""
        if status is not None and status not in set(RunStatus):
            raise InvalidInputError(f"unknown run status {status!r}")
        query = select(RunRow).order_by(RunRow.created_at, RunRow.id)
        if user_id is not None:
            query = query.where(RunRow.user_id == user_id)
        if status is not None:
            query = query.where(RunRow.status == status)
        return await self.db.all(page_after(query, RunRow, after, limit))

    async def set_status(
        self, run_id: str, status: str, failure: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        """Move a run along its state machine (and its session with it).
        ``failure`` ({"code", "message"}) says why a run failed, ended or stalled;
        it is cleared when a stalled run moves on."""
        target = _run_status(status)
        checked = _failure(failure)
        async with self.db.core_transaction() as (connection, _):
            held, now = await locked_run(connection, run_id)
            run = ChainedRun(held["id"], held["last_event_seq"], held["last_event_hash"])
            current = RunStatus(held["status"])
            await move_run_on(connection, run, current, target, checked, held, now)
            await run.write(connection, now)
        return as_written(held, run, now)

    async def move(
        self,
        session: AsyncSession,
        run: RunRow,
        target: RunStatus,
        failure: dict[str, str] | None,
    ) -> bool:
        """The transition itself, under the caller's run lock; False if already there."""
        return await move_run(session, run, target, failure)

    async def record_refusal(
        self, run_id: str, *, call_key: str, seat: str, tool_name: str, code: str, message: str
    ) -> None:
        """A write refused before it became an action (a tenant the run may
        not act for, say): nothing ran, but the log says it was asked for.
        Once per ``call_key``, however often the intercept is retried."""
        key = f"action.refused:{call_key}"
        async with self.db.transaction() as session:
            run = await self.db.lock_run(session, run_id)
            seen = await logged(session, run_id, key)
            if not seen:
                await self.db.audit(
                    session,
                    run,
                    "action.refused",
                    {"seat": seat, "tool_name": tool_name, "code": code, "message": message},
                    await database_now(session),
                    dedupe_key=key[:255],
                )

    async def begin_recovery(
        self,
        run_id: str,
        *,
        from_execution: str,
        by: str,
        note: str,
        reset_to_event: int,
        most: int,
        stale_after: timedelta,
    ) -> str:
        """Claim the recovery of the run's stalled execution before its reset
        (roundtable/recovery.py), audited as ``run.recovery_begun``: who, why,
        which execution, from which event; returns the claim, which only its
        own end_recovery closes. Under the run's lock, so of two operators at
        once one claims and the other is refused (ConflictError): while a
        claim on the same execution is open and younger than ``stale_after``;
        once that execution was recovered; or once the run was recovered
        ``most`` times."""
        async with self.db.transaction() as session:
            run = await self.db.lock_run(session, run_id)
            now = await database_now(session)
            rows = list(
                (
                    await session.execute(
                        select(AuditEventRow)
                        .where(
                            AuditEventRow.run_id == run_id,
                            AuditEventRow.event_type.in_(RECOVERY_EVENTS),
                        )
                        .order_by(AuditEventRow.seq)
                    )
                ).scalars()
            )
            recovered = [r for r in rows if r.event_type == "run.recovered"]
            if any(r.payload.get("from_execution") == from_execution for r in recovered):
                raise ConflictError(f"execution {from_execution} was recovered already")
            if len(recovered) >= most:
                raise ConflictError(
                    f"run {run_id} was recovered {len(recovered)} times; "
                    "look at why it keeps stalling before resetting it again"
                )
            ended = {r.payload.get("claim") for r in rows if r.event_type != "run.recovery_begun"}
            begun = [
                r
                for r in rows
                if r.event_type == "run.recovery_begun"
                and r.payload.get("from_execution") == from_execution
            ]
            for claim in begun:
                if claim.dedupe_key not in ended and now - claim.created_at < stale_after:
                    raise ConflictError(
                        f"a recovery of execution {from_execution} is under way "
                        f"(begun by {claim.payload.get('by')} at {claim.created_at.isoformat()})"
                    )
            key = f"recovery:{from_execution}:{len(begun)}"[:255]
            await self.db.audit(
                session,
                run,
                "run.recovery_begun",
                {
                    "by": by,
                    "note": note,
                    "from_execution": from_execution,
                    "reset_to_event": reset_to_event,
                },
                now,
                dedupe_key=key,
            )
        return key

    async def end_recovery(
        self,
        run_id: str,
        *,
        claim: str,
        from_execution: str,
        to_execution: str | None,
        failure: str | None = None,
        cancel_carried: bool = False,
    ) -> None:
        """The end of the recovery that took ``claim``: ``run.recovered`` with
        the new execution (and whether a cancel requested during the stall
        was carried to it), or ``run.recovery_failed`` with why. Either closes
        that claim only; once per claim."""
        if to_execution is not None:
            kind = "run.recovered"
            payload: dict[str, Any] = {
                "claim": claim,
                "from_execution": from_execution,
                "execution": to_execution,
                "cancel_carried": cancel_carried,
            }
        else:
            kind = "run.recovery_failed"
            payload = {"claim": claim, "from_execution": from_execution, "failure": failure or ""}
        key = f"{kind}:{claim}"[:255]
        async with self.db.transaction() as session:
            run = await self.db.lock_run(session, run_id)
            if not await logged(session, run_id, key):
                await self.db.audit(
                    session, run, kind, payload, await database_now(session), dedupe_key=key
                )

    async def settle_closed(
        self, run_id: str, status: str, failure: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """The run's workflow closed without settling it (terminated, timed out,
        or never started): make the store say so. Each ``executing`` action
        becomes ``unknown`` exactly as with a lost lease (its lease keeps
        running, so it is reconcilable once its attempt cannot be alive); each
        pending approval is withdrawn and each unclaimed write rejected
        (``run_ended``); the run takes the final ``status``. Idempotent."""
        final = RunStatus(status)
        if final not in FINAL_RUN_STATUSES:
            raise InvalidInputError(f"{status!r} is not a final run status")
        open_statuses = (
            ActionStatus.EXECUTING,
            ActionStatus.WAITING_APPROVAL,
            ActionStatus.APPROVED,
        )
        unsettled = [a for a in await self.actions.list(run_id) if a["status"] in open_statuses]
        made_unknown, withdrawn = [], []
        for action in unsettled:
            if action["status"] != ActionStatus.EXECUTING:
                # Read without locks: a claim may have made it executing since
                # (withdraw then leaves it as it is, and it is settled below).
                now_status = (await self.actions.withdraw(action["id"], RUN_ENDED_REASON))["status"]
                if now_status == ActionStatus.REJECTED:
                    withdrawn.append(action["id"])
                if now_status != ActionStatus.EXECUTING:
                    continue
            async with self.db.transaction() as session:
                run, row = await self.db.lock_row(session, ActionRow, action["id"])
                lease = await lease_of(session, row.id)
                now = await database_now(session)
                if await self.leases.mark_unknown(
                    session, run, row, lease, now, WORKFLOW_CLOSED_ERROR_CODE
                ):
                    made_unknown.append(row.id)
        checked = {"code": failure["code"], "message": failure["message"]} if failure else None
        async with self.db.transaction() as session:
            run = await self.db.lock_run(session, run_id)
            if RunStatus(run.status) not in FINAL_RUN_STATUSES:
                await self.move(session, run, final, checked)
        return {
            "run": await self.get(run_id),
            "unknown_actions": made_unknown,
            "withdrawn_actions": withdrawn,
        }
