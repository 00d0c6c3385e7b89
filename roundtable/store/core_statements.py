"""Core statements run without SQLAlchemy's execution around each: what
both databases' fast connections share (sqlite_core.py, pg_core.py).

A run's store calls are Core statements (core_writes.py), and most of their
cost was not the database's: SQLAlchemy's execution of one statement (its
execution context, result metadata and greenlet switch) took several times
the CPU of the trip that ran it (bench/README, "What was cut"). Here a
statement is compiled by SQLAlchemy, once, through the engine's own compiled
cache, and its parameters and rows go through the same bind and result
processors SQLAlchemy would apply; each database's connection then sends it
its own way. So the SQL, the values stored and the values read are
SQLAlchemy's; only its per-statement machinery is left out.

What stays as SQLAlchemy does it: the engine's ``before_cursor_execute``
listeners are told of every statement before it is sent and may change its
SQL and parameters (the store refuses unstorable text there), and
``after_cursor_execute`` listeners after it (tests and the claim's benchmark
count statements there); rows answer as SQLAlchemy's rows and results do for
what the store asks of them (a statement that returns no rows refuses to be
asked for rows). What differs: a listener gets no execution context, and
the cursor an after-listener gets is the cursor's description and row count.
What this refuses rather than imitates: statements whose values SQLAlchemy
would compute in Python (column defaults fetched before an INSERT or
UPDATE) and executemany with RETURNING; the store's hot paths pass every
value.
"""

from __future__ import annotations

import functools
import weakref
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from sqlalchemy import exc
from sqlalchemy.engine import Dialect
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.sql import compiler


class RowMapping(dict):
    """A row's values by column key. A column object finds the value of the
    result column SQLAlchemy compiled it into (not merely one with its key:
    two tables' ``id`` are two columns), and refuses one it is not in or is
    in twice, as SQLAlchemy's RowMapping does; a textual statement's row,
    whose columns only the cursor names, finds it by its key."""

    def __init__(self, row: CoreRow) -> None:
        super().__init__(zip(row._keys, row, strict=True))
        self._row = row

    def __missing__(self, key: Any) -> Any:
        by_object = self._row._by_object
        if isinstance(key, str):
            raise KeyError(key)
        if by_object is None:
            name = getattr(key, "key", None)
            if isinstance(name, str) and name in self:
                return self[name]
            raise KeyError(key)
        index = by_object.get(key)
        if index is None:
            raise exc.NoSuchColumnError(f"Could not locate column in row for column {key!r}")
        if index == _AMBIGUOUS:
            raise exc.InvalidRequestError(f"Ambiguous column name {key!r} in result set")
        return self._row[index]

    # dict's own skip __missing__: a column object is found here too.
    def __contains__(self, key: object) -> bool:
        if dict.__contains__(self, key):
            return True
        if isinstance(key, str):
            return False
        try:
            self.__missing__(key)
        except exc.InvalidRequestError as refused:  # ambiguous: there, twice
            return not isinstance(refused, exc.NoSuchColumnError)
        except KeyError:
            return False
        return True

    def get(self, key: Any, default: Any = None) -> Any:
        try:
            return self[key]
        except KeyError:
            return default


# A column object that stands for two result columns.
_AMBIGUOUS = -1


class CoreRow(tuple):
    """One row: a tuple, with ``_mapping`` and attribute access by column
    key, as SQLAlchemy's Row."""

    __slots__ = ()
    _keys: tuple[str, ...] = ()
    # Each result column's position by the column objects SQLAlchemy
    # compiled into it; None for a textual statement's rows.
    _by_object: Mapping[Any, int] | None = None

    @property
    def _mapping(self) -> RowMapping:
        return RowMapping(self)

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
    """The row class of a textual statement's results."""
    return type("CoreRow", (CoreRow,), {"__slots__": (), "_keys": keys})


def _compiled_row_class(keys: tuple[str, ...], columns: Sequence[Any]) -> type[CoreRow]:
    """The row class of a compiled statement's results (kept with its
    compiled form, not in a cache of its own: the column objects would
    outlive statements built per call)."""
    by_object: dict[Any, int] = {}
    for index, column in enumerate(columns):
        for named in column[2]:
            if not isinstance(named, str):
                by_object[named] = _AMBIGUOUS if named in by_object else index
    return type("CoreRow", (CoreRow,), {"__slots__": (), "_keys": keys, "_by_object": by_object})


# Per statement whose compiled form was made for another (an equal statement
# built again, per call): the row class whose column objects are its own, by
# position, beside the other's, as SQLAlchemy adapts its result metadata to
# the statement invoked. Kept as long as the statement lives.
_INVOKED: weakref.WeakKeyDictionary[Any, tuple[type[CoreRow], type[CoreRow]]] = (
    weakref.WeakKeyDictionary()
)


def _invoked_row_class(made: type[CoreRow], statement: Any) -> type[CoreRow]:
    kept = _INVOKED.get(statement)
    if kept is not None and kept[0] is made:
        return kept[1]
    by_object = dict(made._by_object or {})
    try:  # a SELECT's columns, or an INSERT's, UPDATE's or DELETE's RETURNING
        selected = statement._all_selected_columns
    except (AttributeError, NotImplementedError):
        selected = ()
    by_object.update(
        {column: index for index, column in enumerate(selected) if index < len(made._keys)}
    )
    invoked = type(
        "CoreRow", (CoreRow,), {"__slots__": (), "_keys": made._keys, "_by_object": by_object}
    )
    _INVOKED[statement] = (made, invoked)
    return invoked


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


# Compiled forms kept per statement object (CoreStatements._compiled),
# by identity, the most recently used first out of a bounded table: a
# statement the hot paths build once is found again; one built per call
# passes through without piling up.
_COMPILED_KEPT = 2048
_COMPILED: OrderedDict[tuple[int, int, tuple[str, ...], bool], tuple[Any, ...]] = OrderedDict()
# Per compiled statement (they live in the engine's compiled cache): the
# result's row class and each column's processor, worked out once.
_RESULTS: weakref.WeakKeyDictionary[Any, tuple[type[CoreRow], list[Any]]] = (
    weakref.WeakKeyDictionary()
)


def _result_processing(
    compiled: Any, dialect: Dialect, description: Any
) -> tuple[type[CoreRow] | None, list[Any]]:
    """The result's row class and each column's processor (given the type
    the cursor names, as SQLAlchemy gives it); None for the class when the
    statement returns no rows. A textual statement's columns (no types
    known) are named by the cursor, their values as the driver gives them,
    as SQLAlchemy reads them."""
    if description is None:
        return None, []
    if not compiled._result_columns:
        keys = tuple(column[0] for column in description)
        return _row_class(keys), [None] * len(description)
    known = _RESULTS.get(compiled)
    if known is None:
        columns = compiled._result_columns
        keys = tuple(column[0] for column in columns)
        named = [entry[1] for entry in description]
        if len(named) != len(columns):
            named = [None] * len(columns)
        known = (
            _compiled_row_class(keys, columns),
            [
                column[3]._cached_result_processor(dialect, type_code)
                for column, type_code in zip(columns, named, strict=True)
            ],
        )
        _RESULTS[compiled] = known
    return known


class CursorFacts:
    """What an after-listener is told of the cursor (a fast connection's
    cursor is not SQLAlchemy's to hand out): its description and row count."""

    __slots__ = ("description", "rowcount")

    def __init__(self, description: Any, rowcount: int) -> None:
        self.description = description
        self.rowcount = rowcount


class CoreStatements:
    """A fast connection's statements made ready to send: compiled once,
    their parameters bound and told to the before-listeners; their rows
    made into results. A subclass sets ``dialect``, ``_engine`` (the sync
    engine: its listeners and compiled cache) and ``_sync_connection`` (told
    to the listeners as their connection), and sends."""

    dialect: Dialect
    _engine: Any
    _sync_connection: Any

    async def execute(self, statement: Any, parameters: Any = None) -> CoreResult:
        raise NotImplementedError

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
                "a Core statement on a fast path must pass every value: "
                f"{statement} would take column defaults computed in Python"
            )
        if many and (compiled.effective_returning or compiled.returning):
            raise NotImplementedError("executemany with RETURNING is not on a fast path")
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

    def _result(
        self,
        compiled: Any,
        statement: Any,
        description: Any,
        rows: Sequence[Sequence[Any]],
        rowcount: int,
    ) -> CoreResult:
        made, processors = _result_processing(compiled, self.dialect, description)
        if made is None:
            return CoreResult(None, [], rowcount)
        if made._by_object is not None and statement is not compiled.statement:
            made = _invoked_row_class(made, statement)
        return CoreResult(made._keys, [made(_processed(processors, row)) for row in rows], rowcount)


# What a Core hot path is given: a fast connection (SQLite's, PostgreSQL's),
# or SQLAlchemy's own where the engine's driver is not the one a fast
# connection sends through.
CoreConnection = AsyncConnection | CoreStatements
