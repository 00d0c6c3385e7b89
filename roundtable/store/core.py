"""Transactions, row conversion, sessions, runs and audit reads.

Locking discipline (why there are no deadlocks within a run): every operation
that changes a run's rows locks that run's row *first* (``_lock_run``), and
appends its audit events through the same row. On SQLite ``BEGIN IMMEDIATE``
already serialises writers; on PostgreSQL the run row lock does. Rows shared
between runs (leases, fencing counters) are only ever taken after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import and_, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from roundtable.store.audit import GENESIS_HASH, append_event, verify_chain
from roundtable.store.engine import database_now, read_only_engine
from roundtable.store.errors import ConflictError, InvalidInputError, NotFoundError
from roundtable.store.schema import AuditEventRow, Base, RunRow, SessionRow
from roundtable.store.states import RUN_TRANSITIONS, RunStatus
from roundtable.store.text import escape_text, refuse_unstorable


def row_to_dict(row: Base) -> dict[str, Any]:
    return {column.key: getattr(row, column.key) for column in row.__table__.columns}


def new_id() -> str:
    return str(uuid.uuid4())


def require_text(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise InvalidInputError(f"{name} must be a non-empty string", field=name)
    return refuse_unstorable(name, value)


def _run_status(status: str) -> RunStatus:
    try:
        return RunStatus(status)
    except ValueError as exc:
        raise InvalidInputError(f"unknown run status {status!r}") from exc


def _failure(failure: Mapping[str, Any] | None) -> dict[str, str] | None:
    """A run's failure as stored: a short code and a bounded message."""
    if failure is None:
        return None
    code, message = failure.get("code"), failure.get("message")
    if not isinstance(code, str) or not code or not isinstance(message, str):
        raise InvalidInputError("failure needs a code and a message")
    return {"code": code[:64], "message": message[:2000]}


def require_aware(name: str, value: Any) -> datetime:
    if not isinstance(value, datetime) or value.tzinfo is None:
        raise InvalidInputError(f"{name} must be a timezone-aware datetime")
    return value


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


class StoreCore:
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        # Writers use this factory through _transaction; it is also public for
        # tests and tools that must change rows directly.
        self.session_factory = async_sessionmaker(engine, expire_on_commit=False)
        self._read_factory = async_sessionmaker(read_only_engine(engine), expire_on_commit=False)
        # SQLite admits one writer at a time. Queuing this process's writers
        # here replaces SQLite's busy-handler sleeps with an orderly wait (the
        # 50-claimer test went from 21 s to 4.5 s on this machine). Safety does not depend on
        # it: BEGIN IMMEDIATE and the constraints still serialise, across
        # processes too.
        self._local_writer = asyncio.Lock() if engine.dialect.name == "sqlite" else None

    @asynccontextmanager
    async def _transaction(self) -> AsyncIterator[AsyncSession]:
        async with contextlib.AsyncExitStack() as stack:
            if self._local_writer is not None:
                await stack.enter_async_context(self._local_writer)
            session = await stack.enter_async_context(self.session_factory())
            await stack.enter_async_context(session.begin())
            yield session

    def _reader(self) -> AsyncSession:
        """A session for reads only: never takes SQLite's write lock."""
        return self._read_factory()

    async def _all(self, query: Any) -> list[dict[str, Any]]:
        """Run a read query for whole rows; plain dicts out."""
        async with self._reader() as session:
            return [row_to_dict(row) for row in (await session.execute(query)).scalars()]

    async def _lock_run(self, session: AsyncSession, run_id: str) -> RunRow:
        run = (
            await session.execute(
                select(RunRow)
                .where(RunRow.id == run_id)
                .with_for_update()
                .execution_options(populate_existing=True)
            )
        ).scalar_one_or_none()
        if run is None:
            raise NotFoundError(f"run {run_id!r} not found")
        return run

    @staticmethod
    async def _compare_and_set(
        session: AsyncSession,
        model: type[Base],
        row_id: str,
        expected_statuses: tuple[str, ...],
        values: Mapping[str, Any],
    ) -> bool:
        """``UPDATE … WHERE id = :id AND status IN (:expected)``: True if it changed the row.

        The run lock already makes these transitions exclusive; the guard in the
        statement keeps each one correct even without it.
        """
        result = await session.execute(
            update(model)
            .where(model.id == row_id, model.status.in_(expected_statuses))
            .values(**values)
            .execution_options(synchronize_session=False)
        )
        return result.rowcount == 1

    async def _audit(
        self,
        session: AsyncSession,
        run: RunRow,
        event_type: str,
        payload: Mapping[str, Any],
        now: datetime,
        dedupe_key: str | None = None,
    ) -> None:
        await session.flush()
        await append_event(session, run, event_type, payload, now, dedupe_key)

    # ----------------------------------------------------------- sessions and runs

    async def create_session(self, *, user_id: str, task_text: str) -> dict[str, Any]:
        require_text("user_id", user_id)
        if not isinstance(task_text, str):
            raise InvalidInputError("task_text must be a string", field="task_text")
        refuse_unstorable("task_text", task_text)
        async with self._transaction() as session:
            now = await database_now(session)
            row = SessionRow(
                id=new_id(),
                user_id=user_id,
                task_text=task_text,
                status=RunStatus.PENDING,
                created_at=now,
                updated_at=now,
            )
            session.add(row)
        return row_to_dict(row)

    async def get_session(self, session_id: str) -> dict[str, Any]:
        async with self._reader() as session:
            row = await session.get(SessionRow, session_id)
            if row is None:
                raise NotFoundError(f"session {session_id!r} not found")
            return row_to_dict(row)

    async def create_run(
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
        async with self._transaction() as session:
            owner = await session.get(SessionRow, session_id)
            # Another user's session is reported as missing: ids must not leak.
            if owner is None or owner.user_id != user_id:
                raise NotFoundError(f"session {session_id!r} not found")
            now = await database_now(session)
            run = RunRow(
                id=run_id or new_id(),
                session_id=session_id,
                user_id=user_id,
                status=RunStatus.PENDING,
                last_event_seq=0,
                last_event_hash=GENESIS_HASH,
                request_fingerprint=request_fingerprint,
                granted_write_policy=grant.write_policy,
                started_by_role=grant.role,
                tenants=list(grant.tenants) if grant.tenants is not None else None,
                created_at=now,
                updated_at=now,
            )
            session.add(run)
            await self._audit(
                session,
                run,
                "run.created",
                {"session_id": session_id, **grant.audited()},
                now,
            )
        return row_to_dict(run)

    async def ensure_run(
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
        try:
            run = await self.get_run(run_id)
        except NotFoundError:
            session = await self.create_session(user_id=user_id, task_text=task_text)
            try:
                return await self.create_run(
                    session_id=session["id"],
                    user_id=user_id,
                    run_id=run_id,
                    request_fingerprint=request_fingerprint,
                    grant=grant,
                )
            except IntegrityError:  # created concurrently; theirs stands
                run = await self.get_run(run_id)
        if run["user_id"] != user_id:
            raise ConflictError(f"run {run_id!r} belongs to another user")
        known = run["request_fingerprint"]
        if request_fingerprint and known and known != request_fingerprint:
            raise ConflictError("this Idempotency-Key was already used for a different request")
        return run

    async def pin_snapshot(self, run_id: str, digest: str) -> None:
        """Record the capability snapshot the worker computed for the run (its
        workflow's start, or a reset to it, computes it anew)."""
        async with self._transaction() as session:
            run = await self._lock_run(session, run_id)
            if run.snapshot_digest != digest:
                run.snapshot_digest = digest
                await self._audit(
                    session,
                    run,
                    "run.snapshot_pinned",
                    {"snapshot_digest": digest},
                    await database_now(session),
                )

    async def get_run(self, run_id: str) -> dict[str, Any]:
        async with self._reader() as session:
            row = await session.get(RunRow, run_id)
            if row is None:
                raise NotFoundError(f"run {run_id!r} not found")
            return row_to_dict(row)

    async def list_sessions(self, *, user_id: str | None = None) -> list[dict[str, Any]]:
        query = select(SessionRow).order_by(SessionRow.created_at, SessionRow.id)
        if user_id is not None:
            query = query.where(SessionRow.user_id == user_id)
        return await self._all(query)

    async def list_runs(
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
        return await self._all(page_after(query, RunRow, after, limit))

    async def set_run_status(
        self, run_id: str, status: str, failure: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        """Move a run along its state machine (and its session with it).
        ``failure`` ({"code", "message"}) says why a run failed, ended or stalled;
        it is cleared when a stalled run moves on."""
        target = _run_status(status)
        checked = _failure(failure)
        async with self._transaction() as session:
            run = await self._lock_run(session, run_id)
            await self._move_run(session, run, target, checked)
        return row_to_dict(run)

    async def _move_run(
        self,
        session: AsyncSession,
        run: RunRow,
        target: RunStatus,
        failure: dict[str, str] | None,
    ) -> bool:
        """The transition itself, under the caller's run lock; False if already there."""
        current = RunStatus(run.status)
        if target == current:
            return False
        if target not in RUN_TRANSITIONS[current]:
            raise ConflictError(f"run {run.id!r} cannot go from {current} to {target}")
        now = await database_now(session)
        run.status = target
        run.updated_at = now
        if failure is not None or current == RunStatus.STALLED:
            run.failure = failure
        owner = await session.get(SessionRow, run.session_id)
        if owner is not None:
            owner.status = target
            owner.updated_at = now
        change: dict[str, Any] = {"from": current, "to": target}
        if failure is not None:
            change["failure"] = failure
        await self._audit(session, run, "run.status_changed", change, now)
        return True

    async def record_refusal(
        self, run_id: str, *, call_key: str, seat: str, tool_name: str, code: str, message: str
    ) -> None:
        """A write refused before it became an action (a tenant the run may
        not act for, say): nothing ran, but the log says it was asked for.
        Once per ``call_key``, however often the intercept is retried."""
        key = f"action.refused:{call_key}"
        async with self._transaction() as session:
            run = await self._lock_run(session, run_id)
            seen = await _logged(session, run_id, key)
            if not seen:
                await self._audit(
                    session,
                    run,
                    "action.refused",
                    {"seat": seat, "tool_name": tool_name, "code": code, "message": message},
                    await database_now(session),
                    dedupe_key=key[:255],
                )

    async def record_turn(
        self,
        run_id: str,
        *,
        seat: str,
        round_number: int,
        model: str,
        prompt_tokens: int,
        completion_tokens: int,
        role: str = "seat",
    ) -> bool:
        """A model turn's token usage, in the run's audit log (summed by views).
        Once per turn: a retried turn activity finds its event and adds none
        (False), so the log's usage matches the workflow's."""
        key = escape_text(f"turn.completed:{role}:{seat}:{round_number}")
        async with self._transaction() as session:
            run = await self._lock_run(session, run_id)
            seen = await _logged(session, run_id, key)
            if seen:
                return False
            await self._audit(
                session,
                run,
                "turn.completed",
                {
                    "seat": seat,
                    "round": round_number,
                    "model": model,
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": completion_tokens,
                },
                await database_now(session),
                dedupe_key=key,
            )
        return True

    # ----------------------------------------------------------------- audit reads

    async def list_events(self, run_id: str) -> list[dict[str, Any]]:
        async with self._reader() as session:
            rows = (
                await session.execute(
                    select(AuditEventRow)
                    .where(AuditEventRow.run_id == run_id)
                    .order_by(AuditEventRow.seq)
                )
            ).scalars()
            return [row_to_dict(row) for row in rows]

    async def verify_audit_chain(self, run_id: str) -> bool:
        """Recompute the run's hash chain; False means the log was altered."""
        events = await self.list_events(run_id)
        run = await self.get_run(run_id)
        head = events[-1]["hash"] if events else GENESIS_HASH
        return verify_chain(events) and head == run["last_event_hash"]


async def _logged(session: AsyncSession, run_id: str, dedupe_key: str) -> bool:
    """Whether the run's log already holds the event with this key."""
    found = await session.execute(
        select(AuditEventRow.id).where(
            AuditEventRow.run_id == run_id, AuditEventRow.dedupe_key == dedupe_key
        )
    )
    return found.scalar_one_or_none() is not None


def page_after(query: Any, row: Any, after: tuple[datetime, str] | None, limit: int | None) -> Any:
    """Keyset paging over rows ordered by (created_at, id): those after the
    last one seen, at most ``limit``."""
    if after is not None:
        created, last_id = after
        query = query.where(
            or_(row.created_at > created, and_(row.created_at == created, row.id > last_id))
        )
    return query if limit is None else query.limit(limit)


def numbered_after(query: Any, column: Any, after: int | None, limit: int | None) -> Any:
    """Rows ordered by a growing number (audit seq, delivery id), after ``after``."""
    if after is not None:
        query = query.where(column > after)
    query = query.order_by(column)
    return query if limit is None else query.limit(limit)
