"""What the store's hot paths share when they write with plain statements on a
Core connection (the decision, a write's outcome; the claim has its own):
UPDATEs by id built once, and a run's audit chain appended in memory and
written once at the end, as the ORM path's single flush did.

Building a statement costs more of this process's CPU than SQLite takes to
run it, so each shape is built once (``functools.cache``) with bind
parameters, and only the parameters change between calls.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import cache
from typing import Any

from sqlalchemy import FromClause, Table, bindparam, func, insert, select, update

from roundtable.store.audit import chained_event
from roundtable.store.core_statements import CoreConnection
from roundtable.store.engine import is_postgresql
from roundtable.store.errors import NotFoundError
from roundtable.store.schema import AuditEventRow, RunRow
from roundtable.store.sqlite_core import SQLiteCoreConnection

_RUNS = RunRow.__table__
_EVENTS = AuditEventRow.__table__


@cache
def _update_statement(
    table: Table, keys: tuple[str, ...], guarded: bool, returning: tuple[str, ...]
) -> Any:
    """``UPDATE table SET key = :key, … WHERE id = :row_id [AND status =
    :expected] [RETURNING …]``."""
    statement = (
        update(table)
        .where(table.c.id == bindparam("row_id", type_=table.c.id.type))
        .values({key: bindparam(key, type_=table.c[key].type) for key in keys})
    )
    if guarded:
        statement = statement.where(
            table.c.status == bindparam("expected", type_=table.c.status.type)
        )
    if returning:
        statement = statement.returning(*(table.c[name] for name in returning))
    return statement


async def update_row(
    connection: CoreConnection,
    table: Table,
    row_id: str,
    values: Mapping[str, Any],
    expected: str | None = None,
    returning: tuple[str, ...] = (),
    *,
    later: bool = False,
) -> Any:
    """Set ``values`` on the row ``row_id`` (only while its status is
    ``expected``, when given); the result, for ``returning``'s columns. With
    ``later``, by :func:`write_later`, and no result."""
    statement = _update_statement(table, tuple(sorted(values)), expected is not None, returning)
    params = {**values, "row_id": row_id}
    if expected is not None:
        params["expected"] = expected
    if later:
        return await write_later(connection, statement, params)
    return await connection.execute(statement, params)


async def write_later(connection: CoreConnection, statement: Any, parameters: Any = None) -> None:
    """A write whose answer the transaction does not need (no RETURNING, no
    row count checked): on SQLite it goes with the transaction's next
    statement, in its trip, or with the other writes left at the end in one
    trip before the commit (sqlite_core.py; its error, if any, is raised
    there, and the transaction rolls back all the same); on PostgreSQL it is
    sent at once."""
    if isinstance(connection, SQLiteCoreConnection):
        connection.later(statement, parameters)
    else:
        await connection.execute(statement, parameters)


async def execute_last(connection: CoreConnection, statement: Any, parameters: Any = None) -> Any:
    """The transaction's last statement, whose answer it needs: on SQLite
    sent with the commit, in one trip (and the writes left for later before
    it); on PostgreSQL sent at once, committed when the block ends. Nothing
    may be sent after it."""
    if isinstance(connection, SQLiteCoreConnection):
        return await connection.execute_and_commit(statement, parameters)
    return await connection.execute(statement, parameters)


@dataclass
class ChainedRun:
    """A run locked by this transaction, as the transaction leaves it: the
    events it appends (hash-chained from the head it read) and the run's own
    changes, written by :meth:`write` in two statements."""

    id: str
    last_seq: int
    last_hash: str
    events: list[dict[str, Any]] = field(default_factory=list)
    changes: dict[str, Any] = field(default_factory=dict)

    def append(
        self,
        event_type: str,
        payload: Mapping[str, Any],
        now: datetime,
        dedupe_key: str | None = None,
    ) -> None:
        event = chained_event(
            self.id, self.last_seq, self.last_hash, event_type, payload, now, dedupe_key
        )
        self.events.append(event)
        self.last_seq, self.last_hash = event["seq"], event["hash"]

    async def write(self, connection: CoreConnection, now: datetime) -> None:
        """The events, in their order, then the run's new head (and changes)."""
        if not self.events:
            return
        await self.write_events(connection)
        head = {"last_event_seq": self.last_seq, "last_event_hash": self.last_hash}
        values = {**head, "updated_at": now, **self.changes}
        await update_row(connection, _RUNS, self.id, values, later=True)

    async def write_events(self, connection: CoreConnection) -> None:
        """The events alone, for a run inserted with its head already set."""
        await write_later(connection, insert_into(_EVENTS), self.events)


@cache
def event_logged(payload: bool = False) -> Any:
    """The run's event with a dedupe key, if the log holds it: its id, or
    its payload; binds ``run_id`` and ``key``."""
    return select(_EVENTS.c.payload if payload else _EVENTS.c.id).where(
        _EVENTS.c.run_id == bindparam("run_id"), _EVENTS.c.dedupe_key == bindparam("key")
    )


@cache
def insert_into(table: Table) -> Any:
    """``INSERT INTO table``, built once per table: a fast connection keeps
    each statement's compiled form by the statement object
    (core_statements.py), so one built per call was compiled afresh, its
    cache key generated again, and kept until the bounded cache let it go
    (about 12 KiB of the worker's memory per run at 300 waiting runs,
    bench/README)."""
    return insert(table)


@cache
def lock_owner_run(table: Table) -> Any:
    """PostgreSQL: lock the run that the row ``:row_id`` of ``table`` belongs
    to, found by a subquery in the locking statement itself (no read first
    that a concurrent writer could make stale); for the runs table, the run
    ``:row_id``."""
    row_id = bindparam("row_id", type_=table.c.id.type)
    if table is _RUNS:  # the run itself
        return select(_RUNS.c.id).where(_RUNS.c.id == row_id).with_for_update()
    owner = select(table.c.run_id).where(table.c.id == row_id).scalar_subquery()
    return select(_RUNS.c.id).where(_RUNS.c.id == owner).with_for_update()


def facts_read(postgresql: bool, table: Table, joined: FromClause, columns: list[Any]) -> Any:
    """``SELECT columns, the run's chain head [, clock_timestamp() AS
    database_now] FROM joined WHERE table.id = :row_id``: the one read that
    :func:`locked_facts` runs after the lock (``joined`` must join the run)."""
    chosen = [*columns, _RUNS.c.last_event_seq, _RUNS.c.last_event_hash]
    if postgresql:
        chosen.append(func.clock_timestamp().label("database_now"))
    return (
        select(*chosen)
        .select_from(joined)
        .where(table.c.id == bindparam("row_id", type_=table.c.id.type))
    )


async def locked_facts(
    connection: CoreConnection,
    table: Table,
    row_id: str,
    facts_statement: Callable[[bool], Any],
    noun: str,
) -> tuple[Mapping[str, Any], datetime]:
    """The run lock, then one read of every fact a transaction needs (the
    statement ``facts_statement(postgresql)`` builds, bound to ``:row_id``),
    and the database clock after the lock. PostgreSQL: the run's row lock
    (:func:`lock_owner_run`), then the read, which must return
    ``clock_timestamp()`` as ``database_now``. SQLite: BEGIN IMMEDIATE, sent
    with the read, holds the write lock; the clock (this process's) is read
    once it is held. NotFoundError names the missing ``noun``."""
    postgresql = is_postgresql(connection)
    params = {"row_id": row_id}
    if postgresql:
        locked = await connection.execute(lock_owner_run(table), params)
        if locked.one_or_none() is None:
            raise NotFoundError(f"{noun} {row_id!r} not found")
    row = (await connection.execute(facts_statement(postgresql), params)).one_or_none()
    if row is None:
        raise NotFoundError(f"{noun} {row_id!r} not found")
    facts = row._mapping
    now = facts["database_now"].astimezone(UTC) if postgresql else datetime.now(UTC)
    return facts, now


@cache
def _run_facts(postgresql: bool) -> Any:
    """Every column of the run (its chain head once), for :func:`locked_run`."""
    head = {"last_event_seq", "last_event_hash"}
    return facts_read(postgresql, _RUNS, _RUNS, [c for c in _RUNS.c if c.key not in head])


async def locked_run(connection: CoreConnection, run_id: str) -> tuple[Mapping[str, Any], datetime]:
    """The run ``run_id`` locked by this transaction (:func:`locked_facts`):
    every column as it stands, and the database clock after the lock."""
    return await locked_facts(connection, _RUNS, run_id, _run_facts, "run")


def as_written(held: Mapping[str, Any], run: ChainedRun, now: datetime) -> dict[str, Any]:
    """The run's row as :meth:`ChainedRun.write` leaves it (``held``: every
    column as the transaction read it), with the keys row_to_dict gives."""
    row = {column.key: held[column.key] for column in _RUNS.c}
    if run.events:
        row.update(last_event_seq=run.last_seq, last_event_hash=run.last_hash, updated_at=now)
        row.update(run.changes)
    return row
