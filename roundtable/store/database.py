"""The database core every repository shares: transactions, row locks,
compare-and-set and the audit append.

Locking discipline (why there are no deadlocks within a run): every operation
that changes a run's rows locks that run's row *first* (``lock_run``, or
``lock_row`` for one of its actions or approvals), and appends its audit
events through the same row. On SQLite ``BEGIN IMMEDIATE`` already serialises
writers; on PostgreSQL the run row lock does. Rows shared between runs
(leases, fencing counters) are only ever taken after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from functools import cache
from typing import Any, TypeVar

from sqlalchemy import Select, Table, bindparam, select, update
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from roundtable.completion import to_completion
from roundtable.states import ENDING_ACTION_STATUSES
from roundtable.store import commit_notes, pg_core, sqlite_core, sqlite_readers
from roundtable.store.audit import append_event
from roundtable.store.core_statements import CoreConnection
from roundtable.store.engine import database_clock, database_now, read_only_engine
from roundtable.store.errors import NotFoundError
from roundtable.store.rows import row_to_dict
from roundtable.store.schema import (
    ActionRow,
    ApiTokenRow,
    ApprovalRow,
    AuditEventRow,
    Base,
    RunRow,
    SessionRow,
    ToolResultRow,
)

T = TypeVar("T")
R = TypeVar("R", bound=Base)
log = logging.getLogger("roundtable.store")

# What "not found" calls each kind of row.
_NOUNS: dict[type[Base], str] = {
    SessionRow: "session",
    RunRow: "run",
    ActionRow: "action",
    ApprovalRow: "approval",
    ApiTokenRow: "token",
    ToolResultRow: "tool result",
}


class Database:
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        # Writers use this factory through transaction(); it is also public for
        # tests and tools that must change rows directly.
        self.session_factory = async_sessionmaker(engine, expire_on_commit=False)
        readers = read_only_engine(engine)
        self._readers = readers
        self._read_factory = async_sessionmaker(readers, expire_on_commit=False)
        # SQLite admits one writer at a time. Queuing this process's writers
        # here replaces SQLite's busy-handler sleeps with an orderly wait (the
        # 50-claimer test went from 21 s to 4.5 s on this machine). Safety does
        # not depend on it: BEGIN IMMEDIATE and the constraints still
        # serialise, across processes too.
        self._local_writer = asyncio.Lock() if engine.dialect.name == "sqlite" else None
        # The Core writers' one connection, kept between them: they hold the
        # writer lock while they use it (sqlite_core.HeldConnection).
        self._writer_connection = (
            sqlite_core.HeldConnection(engine) if self._local_writer is not None else None
        )
        # The readers' idle connections, kept between their reads
        # (sqlite_readers.py).
        self._reader_connections = (
            sqlite_readers.HeldReaders(readers) if self._local_writer is not None else None
        )
        # Told what each transaction did once it has committed (metrics).
        self.observers: list[commit_notes.Observer] = []

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[AsyncSession]:
        async with contextlib.AsyncExitStack() as stack:
            if self._local_writer is not None:
                await stack.enter_async_context(self._local_writer)
            # At READ COMMITTED whatever the engine beneath says (under
            # AUTOCOMMIT each statement would commit alone, the run lock gone
            # between them), as core_transaction's; the level goes with the BEGIN.
            made = self._session(self.engine, self.session_factory, "READ COMMITTED")
            session = await stack.enter_async_context(made)
            async with session.begin():
                yield session
            notes = commit_notes.take(session)
        if notes:
            self._tell(notes)

    @asynccontextmanager
    async def core_transaction(
        self,
    ) -> AsyncIterator[tuple[CoreConnection, list[commit_notes.Note]]]:
        """One transaction on a Core connection, for a hot path whose
        statements are all Core (the claim): no ORM session, identity map or
        flush around them, which on PostgreSQL cost more than the claim's own
        statements. The same writer queue and BEGIN (IMMEDIATE on SQLite) as
        :meth:`transaction`, at READ COMMITTED on PostgreSQL; notes appended
        to the list are told once the transaction has committed, and dropped
        with a rollback. The connection is sqlite_core's on SQLite (the same
        ``execute``, plus writes left for later: core_writes.write_later),
        pg_core's on PostgreSQL."""
        notes: list[commit_notes.Note] = []
        async with contextlib.AsyncExitStack() as stack:
            if self._local_writer is not None:
                await stack.enter_async_context(self._local_writer)
                # Each statement one trip, without SQLAlchemy's execution
                # around it (sqlite_core.py).
                sqlite = sqlite_core.transaction(
                    self.engine, "BEGIN IMMEDIATE", self._writer_connection
                )
                yield await stack.enter_async_context(sqlite), notes
            else:
                # The claim's checks rely on READ COMMITTED and its locks on
                # one transaction: pinned on this connection (an engine's
                # option would lose to one set on an engine beneath it),
                # whatever the engine or the database's default says. Under
                # AUTOCOMMIT the first statement's locks would be gone before
                # the second, and current_setting would still say read
                # committed. The level goes with the BEGIN, and the BEGIN is
                # the checkout's ping (pg_core.begun): one trip for the three.
                begun = pg_core.begun(self.engine, isolation_level="READ COMMITTED")
                connection = await stack.enter_async_context(begun)
                await stack.enter_async_context(connection.begin())
                # Each statement one trip, without SQLAlchemy's execution
                # around it (pg_core.py).
                yield pg_core.over(connection), notes
        if notes:
            self._tell(notes)

    @property
    def reader_connections(self) -> sqlite_readers.HeldReaders | None:
        """SQLite's readers' idle connections, kept between reads (None on
        PostgreSQL)."""
        return self._reader_connections

    @property
    def writer_connection(self) -> sqlite_core.HeldConnection | None:
        """SQLite's Core writers' connection, held between them (None on
        PostgreSQL)."""
        return self._writer_connection

    async def close(self) -> None:
        """Give back what is held between transactions (before the engine
        is disposed: the pool closes only what it has back), all of it
        whatever cancels the caller: a close cut after the writers' part
        once left the readers' kept (review). The readers' are marked
        closed and taken at the call, before the first await."""
        readers = self._reader_connections.close() if self._reader_connections else None
        await self._close_writers_then(readers)

    @to_completion
    async def _close_writers_then(self, readers: Awaitable[None] | None) -> None:
        try:
            if self._writer_connection is not None:
                await self._writer_connection.close()
        finally:
            if readers is not None:
                await readers

    def _tell(self, notes: list[commit_notes.Note]) -> None:
        # An observer's failure must not turn a committed write into an error.
        for observer in self.observers:
            try:
                observer(notes)
            except Exception:
                log.exception("commit observer failed")

    def reader(self) -> AsyncSession:
        """A session for reads only: never takes SQLite's write lock."""
        return self._read_factory()

    @asynccontextmanager
    async def snapshot(self) -> AsyncIterator[AsyncSession]:
        """One read-only transaction: all its reads see one instant (on
        PostgreSQL, the instant the block is entered: its BEGIN goes then,
        at REPEATABLE READ pinned on its connection, which an engine beneath
        could not change). It ends by rolling back: READ ONLY still takes
        SET, which a commit would leave on the pooled connection. Rows read
        in it stay readable after it, as after a commit: they are let go of
        before the rollback, which would expire them."""
        # Views that read several tables must agree with themselves: on
        # PostgreSQL at REPEATABLE READ every statement sees the database as
        # of the first; SQLite's deferred transactions in WAL mode do the same.
        made = self._session(self._readers, self._read_factory, "REPEATABLE READ")
        async with made as session, session.begin() as reading:
            yield session
            session.expunge_all()
            await reading.rollback()

    def _session(
        self, engine: AsyncEngine, factory: Any, isolation_level: str
    ) -> contextlib.AbstractAsyncContextManager[AsyncSession]:
        """A session of ``factory``'s; on PostgreSQL, on a connection whose
        BEGIN was its checkout's ping (:func:`_session_on_begun`), at
        ``isolation_level``."""
        if self._local_writer is not None:
            return factory()
        return _session_on_begun(engine, factory, isolation_level)

    async def all(self, query: Any) -> list[dict[str, Any]]:
        """Run a read query for whole rows; plain dicts out."""
        async with self.reader() as session:
            return [row_to_dict(row) for row in (await session.execute(query)).scalars()]

    def core_reader(
        self, alone: bool = False
    ) -> contextlib.AbstractAsyncContextManager[CoreConnection]:
        """A Core connection for reads only (never takes SQLite's write lock),
        for reads on the hot paths: an ORM session around a statement (its
        identity map, the objects built and taken apart again) costs more of
        this process's CPU than the read itself. On SQLite, its statements
        go one trip each (sqlite_core.py), in a deferred transaction; with
        ``alone``, one statement in one trip and no transaction around it.
        On PostgreSQL, pg_core's, in a transaction rolled back at the end.
        On a pool with nothing to lend, a caller cancelled meanwhile still
        waits for the pool (up to its timeout) before its cancellation is
        raised, as the store's public calls, which run to their end, always
        did."""
        if self._local_writer is not None:
            return sqlite_core.reading(self._readers, alone, self._reader_connections)
        return pg_core.reading(self._readers)

    async def get(self, model: type[R], row_id: str) -> dict[str, Any]:
        """One row as a dict (as :func:`row_to_dict` makes it), or NotFoundError."""
        row = await self.find(model, "id", row_id)
        if row is None:
            raise NotFoundError(f"{_NOUNS[model]} {row_id!r} not found")
        return row

    async def find(self, model: type[R], column: str, value: Any) -> dict[str, Any] | None:
        """The row whose unique ``column`` is ``value``, as a dict (as
        :func:`row_to_dict` makes it), or None; one statement, on
        :meth:`core_reader`."""
        table = model.__table__
        async with self.core_reader(alone=True) as connection:
            row = (await connection.execute(_where(table, column), {"value": value})).one_or_none()
        return None if row is None else dict(zip(_keys(table), row, strict=True))

    async def lock_run(self, session: AsyncSession, run_id: str) -> RunRow:
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

    async def lock_row(
        self, session: AsyncSession, model: type[R], row_id: str
    ) -> tuple[RunRow, R]:
        """Lock the run an action or approval belongs to (found by a subquery,
        in the locking statement itself), then read the row afresh (stable
        while the run lock is held)."""
        run = await _lock_owner_run(session, model, row_id)
        return run, await reload(session, model, row_id)

    async def lock_row_and_clock(
        self, session: AsyncSession, model: type[R], row_id: str
    ) -> tuple[RunRow, R, datetime]:
        """:meth:`lock_row`, and the database's clock after the lock, read on
        PostgreSQL by the statement that reads the row afresh (one statement
        instead of two; SQLite's clock is this process's)."""
        clock = database_clock(session)
        if clock is None:
            run, row = await self.lock_row(session, model, row_id)
            return run, row, await database_now(session)
        run = await _lock_owner_run(session, model, row_id)
        row, now = (
            await session.execute(
                select(model, clock)
                .where(model.id == row_id)  # type: ignore[attr-defined]
                .execution_options(populate_existing=True)
            )
        ).one()
        return run, row, now.astimezone(UTC)

    @staticmethod
    async def compare_and_set(
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
            .where(model.id == row_id, model.status.in_(expected_statuses))  # type: ignore[attr-defined]
            .values(**values)
            .execution_options(synchronize_session=False)
        )
        return result.rowcount == 1

    @staticmethod
    async def move_action(
        session: AsyncSession,
        action_id: str,
        expected_statuses: tuple[str, ...],
        values: Mapping[str, Any],
    ) -> bool:
        """``compare_and_set`` for an action: a move to an ending status
        (rejected, succeeded, failed, unknown) is noted for the metrics, with
        the tool read back by the same statement."""
        tool = (
            await session.execute(
                update(ActionRow)
                .where(ActionRow.id == action_id, ActionRow.status.in_(expected_statuses))
                .values(**values)
                .returning(ActionRow.tool_name)
                .execution_options(synchronize_session=False)
            )
        ).scalar_one_or_none()
        if tool is None:
            return False
        if values.get("status") in ENDING_ACTION_STATUSES:
            commit_notes.note(session, commit_notes.ActionEnded(tool, str(values["status"])))
        return True

    # Append to the run's hash-chained log (the caller holds the run lock).
    audit = staticmethod(append_event)

    async def sweep(
        self,
        due: Callable[[datetime], Any],
        settle: Callable[[AsyncSession, str], Awaitable[T | None]],
        now: datetime | None,
    ) -> list[T]:
        """Scan, then recheck: the ids ``due(cutoff)`` selects at ``now``
        (default: the database clock) are read without locks, then each is
        settled in a transaction of its own by ``settle``, which locks and
        checks it again (it may have moved meanwhile) and returns what it
        changed, or None. Safe to run twice or concurrently."""
        async with self.reader() as session:
            cutoff = now or await database_now(session)
            candidates = list((await session.execute(due(cutoff))).scalars())
        settled: list[T] = []
        for row_id in candidates:
            async with self.transaction() as session:
                outcome = await settle(session, row_id)
                if outcome is not None:
                    settled.append(outcome)
        return settled


@cache
def _where(table: Table, column: str) -> Select:
    """``SELECT every column FROM table WHERE column = :value``, built once."""
    return select(table).where(table.c[column] == bindparam("value", type_=table.c[column].type))


@cache
def _keys(table: Table) -> tuple[str, ...]:
    """The names :func:`row_to_dict` gives the columns, in ``select(table)``'s order."""
    return tuple(column.key for column in table.columns)


async def found(session: AsyncSession, model: type[R], row_id: str) -> R:
    """The row with this id, or NotFoundError naming it."""
    row = await session.get(model, row_id)
    if row is None:
        raise NotFoundError(f"{_NOUNS[model]} {row_id!r} not found")
    return row


async def reload(session: AsyncSession, model: type[R], row_id: str) -> R:
    """The row as the database now holds it (not the session's cached copy)."""
    return (
        await session.execute(
            select(model)
            .where(model.id == row_id)  # type: ignore[attr-defined]
            .execution_options(populate_existing=True)
        )
    ).scalar_one()


async def logged(session: AsyncSession, run_id: str, dedupe_key: str) -> bool:
    """Whether the run's log already holds the event with this key."""
    return await logged_payload(session, run_id, dedupe_key) is not None


async def logged_payload(
    session: AsyncSession, run_id: str, dedupe_key: str
) -> dict[str, Any] | None:
    """The payload of the run's event with this key, if the log holds it."""
    hit = await session.execute(
        select(AuditEventRow.payload).where(
            AuditEventRow.run_id == run_id, AuditEventRow.dedupe_key == dedupe_key
        )
    )
    return hit.scalar_one_or_none()


async def _lock_owner_run(session: AsyncSession, model: type[R], row_id: str) -> RunRow:
    """Lock the run a row belongs to, found by a subquery in the locking
    statement itself; NotFoundError when the row is missing (every row has
    its run, a foreign key)."""
    owner = select(model.run_id).where(model.id == row_id).scalar_subquery()  # type: ignore[attr-defined]
    run = (
        await session.execute(
            select(RunRow)
            .where(RunRow.id == owner)
            .with_for_update()
            .execution_options(populate_existing=True)
        )
    ).scalar_one_or_none()
    if run is None:
        raise NotFoundError(f"{_NOUNS[model]} {row_id!r} not found")
    return run


@asynccontextmanager
async def _session_on_begun(
    engine: AsyncEngine, factory: Any, isolation_level: str
) -> AsyncIterator[AsyncSession]:
    """On PostgreSQL, a session on a connection whose BEGIN was its
    checkout's ping (pg_core.begun: one round trip fewer), at
    ``isolation_level``; the session begins and ends that connection's
    transaction as it would its own, and the connection goes back to the
    pool after the session is closed."""
    begun = pg_core.begun(engine, isolation_level=isolation_level)
    async with begun as connection, factory(bind=connection) as session:
        yield session
