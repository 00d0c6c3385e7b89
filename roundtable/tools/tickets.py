"""A demo ticket system: the "outside world" our write tools act on.

It behaves like a well-built customer API should, and it is the ground truth
tests and the chaos harness compare against:
- every write is logged with the idempotency key and fencing token it got,
  with the time it started and finished;
- a repeated idempotency key gets the first answer, nothing is written again,
  and the log counts the repeat (``arrivals``): Roundtable sends each write
  once, so a second arrival is a broken promise the invariant checker reports
  even though this system absorbed it;
- a fencing token lower than one already seen for the ticket is refused (a
  writer whose lease expired cannot clobber its successor).
Its tables live beside Roundtable's (same database by default) but belong to it.
"""

from __future__ import annotations

import asyncio
import contextlib
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    Integer,
    String,
    bindparam,
    insert,
    inspect,
    select,
    text,
    update,
)
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from roundtable.completion import to_completion
from roundtable.store import sqlite_core
from roundtable.store.core_statements import CoreConnection
from roundtable.store.core_writes import write_later
from roundtable.store.engine import create_engine_for, dialect_insert, is_postgresql
from roundtable.tools.registry import (
    ToolContext,
    ToolDefiniteFailure,
    ToolDefinition,
    ToolRegistry,
)

NAMESPACE = "demo-tickets"
REJECTED_STALE = "rejected_stale"


class _Base(DeclarativeBase):
    pass


class TicketRow(_Base):
    __tablename__ = "demo_tickets"

    tenant_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    ticket_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    status: Mapped[str] = mapped_column(String(32), default="open")
    fields: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    comments: Mapped[list[str]] = mapped_column(JSON, default=list)
    highest_fencing_token: Mapped[int] = mapped_column(BigInteger, default=0)


class TicketWriteRow(_Base):
    __tablename__ = "demo_ticket_writes"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    idempotency_key: Mapped[str] = mapped_column(String(255), unique=True)
    fencing_token: Mapped[int] = mapped_column(BigInteger)
    tenant_id: Mapped[str] = mapped_column(String(128))
    ticket_id: Mapped[str] = mapped_column(String(128))
    operation: Mapped[str] = mapped_column(String(32))
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    outcome: Mapped[str] = mapped_column(String(32))
    result: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    # How many calls brought this idempotency key (1: the write ran once).
    arrivals: Mapped[int] = mapped_column(Integer, default=1, server_default="1")


class TicketRef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tenant_id: str = Field(min_length=1, max_length=128)
    ticket_id: str = Field(min_length=1, max_length=128)


class TicketUpdateArgs(TicketRef):
    fields: dict[str, Any] = Field(min_length=1)


class TicketCommentArgs(TicketRef):
    body: str = Field(min_length=1, max_length=10_000)


class TicketCloseArgs(TicketRef):
    resolution: str | None = Field(default=None, max_length=2_000)


def _utc(value: datetime | None) -> str | None:
    if value is None:
        return None
    return (value if value.tzinfo else value.replace(tzinfo=UTC)).isoformat()


class TicketSystem:
    """The demo system. ``write_delay_seconds`` makes writes take time, so a
    test can see whether two of them ever overlapped."""

    def __init__(
        self,
        engine: AsyncEngine,
        write_delay_seconds: float = 0.0,
        drop_after_write: frozenset[str] = frozenset(),
    ) -> None:
        self.engine = engine
        self.write_delay_seconds = write_delay_seconds
        # Chaos: writes to these ticket ids are applied, then the connection
        # "drops" before the answer arrives: the caller cannot know.
        self.drop_after_write = drop_after_write
        self._sessions = async_sessionmaker(engine, expire_on_commit=False)

    @classmethod
    async def open(
        cls,
        database_url: str,
        write_delay_seconds: float = 0.0,
        drop_after_write: frozenset[str] = frozenset(),
    ) -> TicketSystem:
        system = cls(create_engine_for(database_url), write_delay_seconds, drop_after_write)
        await system._create_tables()
        await system._add_arrivals_column()
        return system

    async def _create_tables(self) -> None:
        """Several workers may open at once (the scale bench starts them
        together): on PostgreSQL two CREATE TABLEs of one name race, and the
        loser fails on the catalogue's unique index. It looks again: the
        winner's tables are there, and create_all skips them."""
        for attempt in range(2):
            try:
                async with self.engine.begin() as conn:
                    await conn.run_sync(_Base.metadata.create_all)
                return
            except DBAPIError:
                if attempt:
                    raise

    async def _add_arrivals_column(self) -> None:
        """A write log made before ``arrivals`` existed gets the column (the
        demo's tables are made by create_all, which adds no columns). Several
        workers may open at once: one adds it, the others find it there."""

        def missing(conn: Any) -> bool:
            columns = inspect(conn).get_columns(TicketWriteRow.__tablename__)
            return "arrivals" not in {c["name"] for c in columns}

        async with self.engine.connect() as conn:
            if not await conn.run_sync(missing):
                return
        with contextlib.suppress(DBAPIError):
            async with self.engine.begin() as conn:
                await conn.execute(
                    text(
                        f"ALTER TABLE {TicketWriteRow.__tablename__} "
                        "ADD COLUMN arrivals INTEGER NOT NULL DEFAULT 1"
                    )
                )

    async def close(self) -> None:
        await self.engine.dispose()

    # ----------------------------------------------------------------- reads

    async def get(self, args: TicketRef, ctx: ToolContext) -> dict[str, Any]:
        found = await self.read(args.tenant_id, args.ticket_id)
        if found is None:
            return {"found": False, "tenant_id": args.tenant_id, "ticket_id": args.ticket_id}
        return {"found": True, **found}

    async def read(self, tenant_id: str, ticket_id: str) -> dict[str, Any] | None:
        """A ticket as it stands, or None if nothing was ever written to it."""
        async with self._sessions() as session:
            row = await session.get(TicketRow, (tenant_id, ticket_id))
            if row is None:
                return None
            return {
                "tenant_id": row.tenant_id,
                "ticket_id": row.ticket_id,
                "status": row.status,
                "fields": row.fields,
                "comments": row.comments,
            }

    async def write_log(self) -> list[dict[str, Any]]:
        async with self._sessions() as session:
            rows = (
                await session.execute(select(TicketWriteRow).order_by(TicketWriteRow.id))
            ).scalars()
            return [
                {
                    "idempotency_key": r.idempotency_key,
                    "fencing_token": r.fencing_token,
                    "tenant_id": r.tenant_id,
                    "ticket_id": r.ticket_id,
                    "operation": r.operation,
                    "started_at": _utc(r.started_at),
                    "finished_at": _utc(r.finished_at),
                    "outcome": r.outcome,
                    "arrivals": r.arrivals,
                }
                for r in rows
            ]

    # ----------------------------------------------------------------- writes

    async def update(self, args: TicketUpdateArgs, ctx: ToolContext) -> dict[str, Any]:
        return await self._write("update", args, ctx, lambda row: row.fields.update(args.fields))

    async def comment(self, args: TicketCommentArgs, ctx: ToolContext) -> dict[str, Any]:
        return await self._write("comment", args, ctx, lambda row: row.comments.append(args.body))

    async def close_ticket(self, args: TicketCloseArgs, ctx: ToolContext) -> dict[str, Any]:
        def apply(row: TicketRow) -> None:
            row.status = "closed"
            if args.resolution:
                row.fields["resolution"] = args.resolution

        return await self._write("close", args, ctx, apply)

    async def _write(self, operation: str, args: TicketRef, ctx: ToolContext, apply: Any) -> dict:
        if not ctx.idempotency_key or ctx.fencing_token is None:
            raise ToolDefiniteFailure(
                "missing_write_credentials",
                "ticket writes need an idempotency key and fencing token",
            )
        # Set by _start when it logged this call as started: a cancel that
        # arrives while _start runs is raised once it has finished (it runs
        # to completion), and the entry it made must not stay "started".
        started: list[bool] = []
        try:
            first = await self._start(operation, args, ctx, started)
            if first is not None:
                return first
            if self.write_delay_seconds:
                await asyncio.sleep(self.write_delay_seconds)
            result = await self._finish(args, ctx, apply)
        except asyncio.CancelledError:
            # The caller went away before the write applied: nothing changed,
            # and the log says so (shielded: the note must outlive the cancel).
            # Only this call's own entry: a repeat's belongs to the first call.
            if started:
                await asyncio.shield(self._close_log(ctx, "abandoned"))
            raise
        if args.ticket_id in self.drop_after_write:
            raise ConnectionResetError("connection dropped after the ticket was written")
        return result

    # Writes are plain statements on a Core connection: this system stands in
    # for a customer's, and the benchmark's bare side writes its row with one
    # statement; an ORM session around each of a write's two transactions
    # made the stand-in cost our runs more of the worker's CPU than the
    # customer's system would. On SQLite they go by the store's fast path
    # (store/sqlite_core.py), for the same reason.

    def _transaction(self) -> contextlib.AbstractAsyncContextManager[Any]:
        if self.engine.dialect.name == "sqlite":
            return sqlite_core.transaction(self.engine, "BEGIN IMMEDIATE")
        return self.engine.begin()

    @to_completion
    async def _start(
        self, operation: str, args: TicketRef, ctx: ToolContext, started: list[bool]
    ) -> dict | None:
        async with self._transaction() as conn:
            # The ticket's lock first, then the log: a call with this key that
            # got there first (Roundtable sending one write twice at once, the
            # broken promise ``arrivals`` exists to show) has committed its
            # entry by the time this one holds the lock, and this one is
            # counted, not refused by the log's unique key (PostgreSQL reads
            # what committed since; SQLite's writers are serialised anyway).
            ticket = await _locked_ticket(conn, args)
            seen = await _log_entry(conn, ctx)
            if seen is not None:
                # The repeat is counted (committed), then answered as the first time.
                await write_later(conn, _COUNT_ARRIVAL, {"entry_key": ctx.idempotency_key})
            else:
                highest = ticket.highest_fencing_token
                stale = ctx.fencing_token < highest
                if not stale and ctx.fencing_token > highest:
                    await write_later(
                        conn,
                        _CHANGE_TICKET,
                        {**_ticket_key(args), "highest_fencing_token": ctx.fencing_token},
                    )
                now = datetime.now(UTC)
                await write_later(
                    conn,
                    _LOG_START,
                    {
                        "idempotency_key": ctx.idempotency_key,
                        "fencing_token": ctx.fencing_token,
                        "tenant_id": args.tenant_id,
                        "ticket_id": args.ticket_id,
                        "operation": operation,
                        "started_at": now,
                        # A refusal is logged as durably as a write: the log is the truth.
                        "finished_at": now if stale else None,
                        "outcome": REJECTED_STALE if stale else "started",
                        "arrivals": 1,
                    },
                )
                if not stale:
                    started.append(True)
        if seen is not None:
            if seen.outcome == REJECTED_STALE:
                raise ToolDefiniteFailure("stale_fencing_token", "this write was refused")
            return {**(seen.result or {}), "replayed": True}
        if stale:
            raise ToolDefiniteFailure(
                "stale_fencing_token",
                f"fencing token {ctx.fencing_token} is older than {highest} for this ticket",
            )
        return None

    @to_completion
    async def _finish(self, args: TicketRef, ctx: ToolContext, apply: Any) -> dict[str, Any]:
        async with self._transaction() as conn:
            ticket = await _locked_ticket(conn, args)
            if ctx.fencing_token >= ticket.highest_fencing_token:
                # The handler changes a copy; the copy is written back whole.
                changed = SimpleNamespace(
                    status=ticket.status,
                    fields=dict(ticket.fields),
                    comments=list(ticket.comments),
                )
                apply(changed)
                await write_later(conn, _CHANGE_TICKET, {**_changes(changed), **_ticket_key(args)})
                result = {
                    "ticket_id": args.ticket_id,
                    "status": changed.status,
                    "external_object_id": f"{args.tenant_id}/{args.ticket_id}",
                }
                await _end_log(conn, ctx, "applied", result)
                return result
            # Refused: committed as the write's end before the caller hears of it.
            await _end_log(conn, ctx, REJECTED_STALE)
        raise ToolDefiniteFailure("stale_fencing_token", "a newer writer took over")

    @to_completion
    async def fence(self, args: TicketRef, ctx: ToolContext) -> bool:
        """From now on, refuse this attempt's write (and any older one) to this
        ticket: True. False when the log shows the write already applied (the
        operator's "failed" would be wrong). Under the ticket's row lock, so a
        write is either applied before this or refused after it."""
        async with self._transaction() as conn:
            ticket = await _locked_ticket(conn, args)
            log = await _log_entry(conn, ctx)
            if log is not None and log.outcome == "applied":
                return False
            below = (ctx.fencing_token or 0) + 1
            if below > ticket.highest_fencing_token:
                await write_later(
                    conn, _CHANGE_TICKET, {**_ticket_key(args), "highest_fencing_token": below}
                )
            return True

    @to_completion
    async def _close_log(self, ctx: ToolContext, outcome: str) -> None:
        async with self._transaction() as conn:
            await _end_log(conn, ctx, outcome, only_if="started")


_TICKETS = TicketRow.__table__
_LOG = TicketWriteRow.__table__

# A write's statements, built once, their values passed as parameters: a
# statement built per call with its values in it is a new SQLAlchemy cache
# key to generate each time, about 3.4% of a worker's Python time per run
# (bench/README, "What was cut"). The keys' parameters are named apart from
# the columns: an UPDATE sets the columns its parameters name (and
# SQLAlchemy refuses a bound key named like a column).
_IS_TICKET = (
    _TICKETS.c.tenant_id == bindparam("key_tenant", type_=_TICKETS.c.tenant_id.type),
    _TICKETS.c.ticket_id == bindparam("key_ticket", type_=_TICKETS.c.ticket_id.type),
)
_IS_ENTRY = _LOG.c.idempotency_key == bindparam("entry_key", type_=_LOG.c.idempotency_key.type)
_LOCK_TICKET = select(_TICKETS).where(*_IS_TICKET).with_for_update()
# Sets the columns its parameters name besides the key's.
_CHANGE_TICKET = update(_TICKETS).where(*_IS_TICKET)
_READ_ENTRY = select(_LOG.c.outcome, _LOG.c.result).where(_IS_ENTRY)
_COUNT_ARRIVAL = update(_LOG).where(_IS_ENTRY).values(arrivals=_LOG.c.arrivals + 1)
_LOG_START = insert(_LOG)
_END_ENTRY = update(_LOG).where(_IS_ENTRY)
_END_ENTRY_IF = _END_ENTRY.where(
    _LOG.c.outcome == bindparam("entry_only_if", type_=_LOG.c.outcome.type)
)
# The ticket made on its first write; each dialect's, as both have their own
# ON CONFLICT.
_MAKE_TICKET = {
    on_postgresql: dialect_insert(on_postgresql, _TICKETS).on_conflict_do_nothing()
    for on_postgresql in (False, True)
}


def _ticket_key(args: TicketRef) -> dict[str, str]:
    return {"key_tenant": args.tenant_id, "key_ticket": args.ticket_id}


# What a write's handler may change on its copy of the ticket.
_CHANGEABLE = frozenset({"status", "fields", "comments"})


def _changes(changed: SimpleNamespace) -> dict[str, Any]:
    """The handler's copy as the columns to set. Anything else it set is
    refused (raised inside the write's transaction, so nothing applies):
    given as a parameter, a name that is no column would be ignored and
    the write logged ``applied`` without it."""
    values = vars(changed)
    if values.keys() != _CHANGEABLE:
        unknown = sorted(values.keys() - _CHANGEABLE)
        raise ValueError(f"a ticket write changes only {sorted(_CHANGEABLE)}, not {unknown}")
    return values


async def _locked_ticket(conn: CoreConnection, args: TicketRef) -> Any:
    """The ticket's row, made if it was never written to, row-locked
    (PostgreSQL; SQLite's writers are serialised anyway): a write's
    check-then-apply and a fence never interleave."""
    key = _ticket_key(args)
    ticket = (await conn.execute(_LOCK_TICKET, key)).one_or_none()
    if ticket is not None:
        return ticket
    # Two first writers of one ticket: one makes it, the other then locks it.
    made = {
        "tenant_id": args.tenant_id,
        "ticket_id": args.ticket_id,
        "status": "open",
        "fields": {},
        "comments": [],
        "highest_fencing_token": 0,
    }
    inserted = await conn.execute(_MAKE_TICKET[is_postgresql(conn)], made)
    if inserted.rowcount == 1:
        # Ours: the row is as made, and no other writer sees it before we commit.
        return SimpleNamespace(**made)
    return (await conn.execute(_LOCK_TICKET, key)).one()


async def _log_entry(conn: CoreConnection, ctx: ToolContext) -> Any:
    """The write log's entry for this call's idempotency key, if any."""
    return (await conn.execute(_READ_ENTRY, {"entry_key": ctx.idempotency_key})).one_or_none()


async def _end_log(
    conn: CoreConnection,
    ctx: ToolContext,
    outcome: str,
    result: dict[str, Any] | None = None,
    only_if: str | None = None,
) -> None:
    """The log entry of this call ends: ``outcome`` (and ``result``), now;
    with ``only_if``, only an entry still in that state (if any). Without
    it the entry must be there: the log is the ground truth, and a write
    never applies without its entry."""
    values: dict[str, Any] = {
        "entry_key": ctx.idempotency_key,
        "outcome": outcome,
        "finished_at": datetime.now(UTC),
    }
    if result is not None:
        values["result"] = result
    if only_if is not None:
        values["entry_only_if"] = only_if
    ended = await conn.execute(_END_ENTRY if only_if is None else _END_ENTRY_IF, values)
    if only_if is None and ended.rowcount != 1:
        # No entry to end: the write must not apply unlogged. Raised inside
        # the transaction, so the ticket's change rolls back with it.
        raise RuntimeError(f"no write log entry for {ctx.idempotency_key!r}")


def register_ticket_tools(registry: ToolRegistry, system: TicketSystem) -> None:
    tools = (
        (
            "ticket_get",
            "Read a ticket: status, fields and comments.",
            TicketRef,
            "read",
            "R0",
            system.get,
        ),
        (
            "ticket_comment",
            "Add a comment to a ticket.",
            TicketCommentArgs,
            "write",
            "R1",
            system.comment,
        ),
        (
            "ticket_update",
            "Set fields on a ticket.",
            TicketUpdateArgs,
            "write",
            "R2",
            system.update,
        ),
        (
            "ticket_close",
            "Close a ticket, optionally with a resolution.",
            TicketCloseArgs,
            "write",
            "R3",
            system.close_ticket,
        ),
    )
    for name, description, args_model, side_effect, risk_level, handler in tools:
        registry.register(
            ToolDefinition(
                name=name,
                description=description,
                args_model=args_model,
                side_effect=side_effect,
                risk_level=risk_level,
                handler=handler,
                # Every tool names the ticket the same way, so writes to one
                # ticket share a lease whichever tool makes them.
                target_key_fields=("tenant_id", "ticket_id"),
                tenant_field="tenant_id",
                target_key_namespace=NAMESPACE,
                safe_argument_fields=("tenant_id", "ticket_id", "fields"),
                # The demo system writes in this process, in one transaction:
                # when the call has ended, so has everything it did.
                effects_end_with_call=True,
                fence=system.fence,
            )
        )
