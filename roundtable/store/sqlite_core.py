"""Core statements on SQLite without SQLAlchemy's execution around each.

A run's store calls are Core statements (core_writes.py), and on SQLite most
of their cost was not SQLite's: SQLAlchemy's execution of one statement (its
execution context, result metadata and greenlet switch) took about three
times the CPU of the trip that ran it (bench/README, "What was cut"). Here a
statement is compiled by SQLAlchemy, once, through the engine's own compiled
cache, and its parameters and rows go through the same bind and result
processors SQLAlchemy would apply; the statement itself runs through the
connection's one-trip cursor (sqlite_driver.py). So the SQL, the values
stored and the values read are SQLAlchemy's; only its per-statement
machinery is left out.

What stays as SQLAlchemy does it: the engine's ``before_cursor_execute``
listeners are told of every statement before it is sent and may change its
SQL and parameters (the store refuses unstorable text there), and
``after_cursor_execute``, ``commit`` and ``rollback`` listeners are told in
SQLAlchemy's order (tests and the claim's benchmark count statements
there); a database error, or a value a type refuses, is raised as the same
``sqlalchemy.exc`` class, its parameters hidden as the engine hides them;
rows answer as SQLAlchemy's rows and results do for what the store asks of
them (a statement that returns no rows refuses to be asked for rows).
What differs, and is told here: a listener gets no execution context, and
the cursor an after-listener gets is the cursor's description and row count
(the cursor itself lives on SQLite's thread); the engine's ``begin`` event
is not fired (its one listener, engine.py's, is what sends BEGIN on
SQLAlchemy's path; here the BEGIN is sent, and told, as a statement). What
this refuses rather than imitates: statements whose values SQLAlchemy would
compute in Python (column defaults fetched before an INSERT or UPDATE) and
executemany with RETURNING; the store's hot paths pass every value.

PostgreSQL is untouched: its hot paths run on SQLAlchemy's AsyncConnection.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any

from sqlalchemy import exc
from sqlalchemy.engine import Dialect
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from sqlalchemy.sql import compiler

from roundtable.store.sqlite_driver import OneTripConnection


class RowMapping(dict):
    """A row's values by column key; a column object finds its own key,
    as in SQLAlchemy's RowMapping."""

    def __missing__(self, key: Any) -> Any:
        name = getattr(key, "key", None)
        if isinstance(name, str) and name in self:
            return self[name]
        raise KeyError(key)


class CoreRow(tuple):
    """One row: a tuple, with ``_mapping`` and attribute access by column
    key, as SQLAlchemy's Row."""

    __slots__ = ()
    _keys: tuple[str, ...] = ()

    @property
    def _mapping(self) -> RowMapping:
        return RowMapping(zip(self._keys, self, strict=True))

    def _asdict(self) -> dict[str, Any]:
        return dict(self._mapping)

    def __getattr__(self, key: str) -> Any:
        try:
            return self[self._keys.index(key)]
        except ValueError:
            raise AttributeError(key) from None


def _processed(processors: list[Any], row: Sequence[Any]) -> Iterator[Any]:
    return (value if p is None else p(value) for p, value in zip(processors, row, strict=True))


@functools.cache
def _row_class(keys: tuple[str, ...]) -> type[CoreRow]:
    return type("CoreRow", (CoreRow,), {"__slots__": (), "_keys": keys})


def _one(rows: Sequence[Any], required: bool) -> Any:
    """The only row, as SQLAlchemy's ``one``/``one_or_none`` find it."""
    if len(rows) > 1:
        raise exc.MultipleResultsFound(
            "Multiple rows were found when exactly one was required"
            if required
            else "Multiple rows were found when one or none was required"
        )
    if not rows:
        if required:
            raise exc.NoResultFound("No row was found when one was required")
        return None
    return rows[0]


class CoreResult:
    """The part of SQLAlchemy's CursorResult the store's Core paths use:
    every row is already fetched. A statement that returns no rows (an
    UPDATE without RETURNING) has only its row count: asking it for rows is
    an error, as in SQLAlchemy, not an empty answer."""

    def __init__(self, keys: tuple[str, ...] | None, rows: list[CoreRow], rowcount: int) -> None:
        self._keys = keys
        self._fetched = rows
        self.rowcount = rowcount

    @property
    def returns_rows(self) -> bool:
        return self._keys is not None

    @property
    def _rows(self) -> list[CoreRow]:
        if self._keys is None:
            raise exc.ResourceClosedError(
                "This result object does not return rows. It has been closed automatically."
            )
        return self._fetched

    def keys(self) -> list[str]:
        return list(self._keys or ())

    def __iter__(self) -> Iterator[CoreRow]:
        return iter(self._rows)

    def all(self) -> list[CoreRow]:
        return list(self._rows)

    def first(self) -> CoreRow | None:
        rows = self._rows
        return rows[0] if rows else None

    def one_or_none(self) -> CoreRow | None:
        return _one(self._rows, required=False)

    def one(self) -> CoreRow:
        return _one(self._rows, required=True)

    def scalar(self) -> Any:
        row = self.first()
        return None if row is None else row[0]

    def scalar_one(self) -> Any:
        return self.one()[0]

    def scalar_one_or_none(self) -> Any:
        row = self.one_or_none()
        return None if row is None else row[0]

    def scalars(self) -> CoreScalars:
        return CoreScalars([row[0] for row in self._rows])

    def mappings(self) -> CoreScalars:
        return CoreScalars([row._mapping for row in self._rows])


class CoreScalars(list):
    """A list with the ``all``/``first``/``one``/``one_or_none`` a
    ScalarResult offers."""

    def all(self) -> list[Any]:
        return list(self)

    def first(self) -> Any:
        return self[0] if self else None

    def one(self) -> Any:
        return _one(self, required=True)

    def one_or_none(self) -> Any:
        return _one(self, required=False)


# Compiled forms kept per statement object (SQLiteCoreConnection._compiled),
# by identity, the most recently used first out of a bounded table: a
# statement the hot paths build once is found again; one built per call
# passes through without piling up.
_COMPILED_KEPT = 2048
_COMPILED: OrderedDict[tuple[int, int, tuple[str, ...], bool], tuple[Any, ...]] = OrderedDict()
# Per compiled statement (they live in the engine's compiled cache): the
# result's keys and each column's processor, worked out once.
_RESULTS: weakref.WeakKeyDictionary[Any, tuple[tuple[str, ...], list[Any]]] = (
    weakref.WeakKeyDictionary()
)


def _result_processing(
    compiled: Any, dialect: Dialect, description: Any
) -> tuple[tuple[str, ...] | None, list[Any]]:
    """The result's keys and each column's processor; None for keys when
    the statement returns no rows. A textual statement's columns (no types
    known) are named by the cursor, their values as SQLite gives them, as
    SQLAlchemy reads them."""
    if description is None:
        return None, []
    if not compiled._result_columns:
        return tuple(column[0] for column in description), [None] * len(description)
    known = _RESULTS.get(compiled)
    if known is None:
        columns = compiled._result_columns
        keys = tuple(column[0] for column in columns)
        known = keys, [column[3]._cached_result_processor(dialect, None) for column in columns]
        _RESULTS[compiled] = known
    return known


class CursorFacts:
    """What an after-listener is told of the cursor (the one-trip cursor
    is made and closed on SQLite's thread): its description and row count."""

    __slots__ = ("description", "rowcount")

    def __init__(self, description: Any, rowcount: int) -> None:
        self.description = description
        self.rowcount = rowcount


class SQLiteCoreConnection:
    """A transaction's connection on SQLite, for Core statements: what the
    store's hot paths call of SQLAlchemy's AsyncConnection (``execute`` and
    ``dialect``), each statement one trip to SQLite's thread."""

    def __init__(
        self,
        engine: AsyncEngine,
        driver: OneTripConnection,
        sync_connection: Any,
        *,
        read_only: bool = False,
        alone: bool = False,
    ) -> None:
        self._engine = engine.sync_engine
        self.dialect: Dialect = engine.dialect
        self._driver = driver
        # Told to the listeners as their connection argument, as SQLAlchemy does.
        self._sync_connection = sync_connection
        # Writes prepared by later(), not sent yet.
        self._later: list[tuple[str, Any, bool]] = []
        self._read_only = read_only
        # One statement only, outside any transaction (reading(alone=True)).
        self._alone = alone
        self._sent = 0

    async def execute(self, statement: Any, parameters: Any = None) -> CoreResult:
        if self._alone and self._sent:
            raise RuntimeError("a lone read runs one statement; use a reading transaction")
        self._sent += 1
        step, compiled = self._step(statement, parameters)
        # Writes left for later go first, in this statement's trip.
        steps, self._later = [*self._later, step], []
        description, rows, rowcount = (await self._send(steps))[-1]
        keys, processors = _result_processing(compiled, self.dialect, description)
        if keys is None:
            return CoreResult(None, [], rowcount)
        made = _row_class(keys)
        return CoreResult(keys, [made(_processed(processors, row)) for row in rows], rowcount)

    def later(self, statement: Any, parameters: Any = None) -> None:
        """A write whose answer the transaction does not need (an INSERT, an
        UPDATE whose row count nobody checks): prepared and told to the
        listeners now (so unstorable text is refused here, as ``execute``
        refuses it), sent with the transaction's next statement, in its
        trip, or in one trip just before the commit. Its error, if any, is
        raised there. A reader's connection refuses it: nothing would send
        it."""
        if self._read_only:
            raise RuntimeError("a reading connection does not write; use a transaction")
        self._later.append(self._step(statement, parameters)[0])

    def _step(self, statement: Any, parameters: Any) -> tuple[tuple[str, Any, bool], Any]:
        """The statement ready to send, as the before-listeners leave it
        (each returns the SQL and parameters, changed or not, as SQLAlchemy
        has them do); its compiled form."""
        many = isinstance(parameters, list | tuple) and len(parameters) > 1
        groups: Sequence[Mapping[str, Any]]
        if parameters is None:
            groups = []
        elif isinstance(parameters, list | tuple):
            groups = parameters
        else:
            groups = [parameters]
        compiled, sql, bound = self._prepared(statement, groups, many)
        sent: Any = bound if many else bound[0]
        for listener in self._engine.dispatch.before_cursor_execute:
            sql, sent = listener(self._sync_connection, None, sql, sent, None, many)
        return (sql, sent, many), compiled

    def _prepared(
        self, statement: Any, groups: Sequence[Mapping[str, Any]], many: bool
    ) -> tuple[Any, str, list[tuple[Any, ...]]]:
        """The compiled statement, its SQL and each group's parameters in
        their order and processed, as SQLAlchemy's execution context makes
        them (DefaultExecutionContext._init_compiled); a value a processor
        refuses (a naive datetime) raised as SQLAlchemy raises it."""
        compiled, extracted, collected = self._compiled(statement, groups, many)
        if compiled.insert_prefetch or compiled.update_prefetch:
            raise NotImplementedError(
                "a Core statement on SQLite's fast path must pass every value: "
                f"{statement} would take column defaults computed in Python"
            )
        if many and (compiled.effective_returning or compiled.returning):
            raise NotImplementedError("executemany with RETURNING is not on SQLite's fast path")
        try:
            return (compiled, *self._bound(compiled, extracted, collected, groups, many))
        except (NotImplementedError, exc.SQLAlchemyError):
            raise
        except Exception as error:
            raise exc.DBAPIError.instance(
                compiled.string,
                groups,
                error,
                self.dialect.loaded_dbapi.Error,
                hide_parameters=True,
                dialect=self.dialect,
            ) from error

    @staticmethod
    def _bound(
        compiled: Any,
        extracted: Any,
        collected: Any,
        groups: Sequence[Mapping[str, Any]],
        many: bool,
    ) -> tuple[str, list[tuple[Any, ...]]]:
        values = [
            compiled.construct_params(
                group,
                escape_names=False,
                _group_number=number,
                extracted_parameters=extracted,
                _collected_params=collected,
            )
            for number, group in enumerate(groups)
        ] or [
            compiled.construct_params(
                extracted_parameters=extracted, escape_names=False, _collected_params=collected
            )
        ]
        processors: Mapping[str, Any] = compiled._bind_processors
        sql = compiled.string
        order = compiled.positiontup
        if compiled.literal_execute_params or compiled.post_compile_params:
            if many:
                raise NotImplementedError("expanding parameters with executemany")
            expanded = compiled._process_parameters_for_postcompile(values[0])
            sql = expanded.statement
            processors = {**processors, **expanded.processors}
            order = expanded.positiontup
        bound = [
            tuple(processors[key](value[key]) if key in processors else value[key] for key in order)
            for value in values
        ]
        return sql, bound

    def _compiled(
        self, statement: Any, groups: Sequence[Mapping[str, Any]], many: bool
    ) -> tuple[Any, Any, Any]:
        """SQLAlchemy's compiled form of ``statement`` for these parameter
        names, with the values built into the statement. A statement is
        immutable, so what its cache key gives is kept for the statement
        itself (the hot paths build theirs once): generating the key again
        on every call cost more than the rest of the preparation."""
        names = tuple(sorted(groups[0])) if groups else ()
        key = (id(self.dialect), id(statement), names, many)
        kept = _COMPILED.get(key)
        # Ids are reused once an object is gone: the entry holds both, and
        # counts only if they are these very objects.
        if kept is not None and kept[0] is self.dialect and kept[1] is statement:
            _COMPILED.move_to_end(key)
            return kept[2:]
        compiled, extracted, collected, _ = statement._compile_w_cache(
            dialect=self.dialect,
            compiled_cache=self._engine._compiled_cache,
            column_keys=list(names),
            for_executemany=many,
            schema_translate_map=None,
            linting=self.dialect.compiler_linting | compiler.WARN_LINTING,
        )
        _COMPILED[key] = (self.dialect, statement, compiled, extracted, collected)
        if len(_COMPILED) > _COMPILED_KEPT:
            _COMPILED.popitem(last=False)
        return compiled, extracted, collected

    async def _send(self, steps: list[tuple[str, Any, bool]]) -> list[tuple[Any, list[Any], int]]:
        """The statements in one trip to SQLite's thread, told to the
        after-listeners (with what the cursor gave: description and row
        count); an error raised as SQLAlchemy raises it, for the statement
        that failed."""
        error_class = self.dialect.loaded_dbapi.Error
        sent = [("executemany" if many else "execute", sql, bound) for sql, bound, many in steps]
        try:
            done = await self._driver.run_steps(sent)
        except error_class as error:
            sql, bound, many = steps[getattr(error, "step", -1)]
            raise exc.DBAPIError.instance(
                sql,
                bound,
                error,
                error_class,
                hide_parameters=True,
                dialect=self.dialect,
                ismulti=many,
            ) from error
        dispatch = self._engine.dispatch
        for (sql, bound, many), (description, _, rowcount) in zip(steps, done, strict=True):
            cursor = CursorFacts(description, rowcount)
            dispatch.after_cursor_execute(self._sync_connection, cursor, sql, bound, None, many)
        return done

    async def begin(self, sql: str) -> None:
        """Open the transaction: ``sql`` goes with the first statement (the
        one-trip cursor holds it back while the connection is known idle)."""
        dispatch = self._engine.dispatch
        dispatch.before_cursor_execute(self._sync_connection, None, sql, (), None, False)
        await self._driver.cursor().execute(sql)
        facts = CursorFacts(None, -1)
        dispatch.after_cursor_execute(self._sync_connection, facts, sql, (), None, False)

    async def commit(self) -> None:
        # Writes left for later go in one trip before the commit's: the
        # listeners hear of them before the transaction commits, and a
        # transaction cancelled while they run rolls back, as before.
        steps, self._later = self._later, []
        if steps:
            await self._send(steps)
        # Told before the commit, as SQLAlchemy tells it: a listener that
        # raises stops the commit (the caller then rolls back).
        self._engine.dispatch.commit(self._sync_connection)
        try:
            await self._driver.commit()
        except self.dialect.loaded_dbapi.Error as error:
            raise exc.DBAPIError.instance(
                "COMMIT", (), error, self.dialect.loaded_dbapi.Error, dialect=self.dialect
            ) from error

    async def rollback(self) -> None:
        self._later = []  # never sent
        self._engine.dispatch.rollback(self._sync_connection)
        await self._driver.rollback()


async def _own(
    engine: AsyncEngine, pooled: AsyncConnection, **options: bool
) -> SQLiteCoreConnection | None:
    """This module's connection over the pooled one; None on an engine
    built on aiosqlite's own driver, which keeps SQLAlchemy's."""
    driver = (await pooled.get_raw_connection()).driver_connection
    if not isinstance(driver, OneTripConnection):
        return None
    return SQLiteCoreConnection(engine, driver, pooled.sync_connection, **options)


@contextlib.asynccontextmanager
async def transaction(engine: AsyncEngine, begin: str) -> AsyncIterator[CoreConnection]:
    """A pooled connection, in one transaction opened by ``begin`` (``BEGIN
    IMMEDIATE`` for a writer, ``BEGIN`` for a reader): committed when the
    block ends, rolled back when it raises (or is cancelled). An engine
    built on aiosqlite's own driver (tests compare against it) gets
    SQLAlchemy's connection, as before."""
    async with engine.connect() as pooled:
        connection = await _own(engine, pooled)
        if connection is None:
            async with pooled.begin():
                yield pooled
            return
        await connection.begin(begin)
        try:
            yield connection
            await connection.commit()
        except BaseException:
            await connection.rollback()
            raise


@contextlib.asynccontextmanager
async def reading(engine: AsyncEngine, alone: bool = False) -> AsyncIterator[CoreConnection]:
    """A pooled connection in a deferred transaction, rolled back at the end:
    its reads see one instant and take no write lock. ``alone``: for one
    statement only, sent with no transaction around it (SQLite's autocommit
    gives a lone statement its own), one trip in all; a second is refused.
    (aiosqlite's own driver: as :func:`transaction`.)"""
    async with engine.connect() as pooled:
        connection = await _own(engine, pooled, read_only=True, alone=alone)
        if connection is None:
            yield pooled
            return
        if alone:
            yield connection
            return
        await connection.begin("BEGIN")
        try:
            yield connection
        finally:
            await connection.rollback()


# What a Core hot path is given: SQLAlchemy's connection on PostgreSQL, this
# module's on SQLite.
CoreConnection = AsyncConnection | SQLiteCoreConnection
