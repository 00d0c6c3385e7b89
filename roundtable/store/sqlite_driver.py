"""aiosqlite, one call per statement (not four), on the event loop when it can.

aiosqlite runs every sqlite3 call on a thread of its own and hands each
result back to the event loop. SQLAlchemy's adapter makes four such calls
per statement: open a cursor, execute, fetch the rows, close the cursor.
Each trip wakes the event loop, resolves a future and switches greenlets,
and that machinery, not SQLite, was most of the store's CPU (bench/README,
"Where the time goes now"). Here the cursor does all four in one trip: the
rows, description, row count and last row id are read on the thread and
kept, and the fetches that follow return them without a trip.

Two more trips per transaction are saved where nothing can differ:

- A ``BEGIN`` goes with the statement after it, in its trip. It is held
  back only on a connection known to be idle outside a transaction, so the
  ``BEGIN`` cannot fail for a transaction left open; if it fails otherwise
  (the write lock's busy timeout) that error is the statement's, and the
  statement is not run. A transaction with no statement sends nothing. A
  call of aiosqlite's own (``execute``, ``executemany``, ...) takes the held
  ``BEGIN`` with it too, so it runs inside the transaction, as before.
- A rollback on a connection known to be idle outside a transaction is not
  sent: the pool's rollback when a connection is returned after its commit,
  or a second rollback. "Known" means the last call queued for the thread was
  a commit or rollback that completed, no transaction open, and nothing was
  queued since (counted: another task's call queued while the end ran, on a
  connection two tasks share, leaves it unknown); any other call, or a call
  cancelled or failed, forgets it, and the rollback is sent as before (queued
  behind whatever the thread still runs).

A transaction's last statement may also take the commit with it
(``run_steps(..., commit=True)``, sqlite_core's ``execute_and_commit``): one
trip for BEGIN, statement and COMMIT, the connection known idle after it.

Calls run on the event loop while the thread is idle. Handing a call to
the thread and its answer back cost more CPU than most statements do (a
queue, two wake-ups, the GIL passed twice): on a loaded worker, about a
sixth of a run's CPU (bench/README, "What was cut"). So this module's calls
(a statement, a trip of them, a commit or rollback) run on the event loop
when nothing of the connection's is queued or running on its thread
(counted by the thread's queue), on a connection the engine allowed it on
(``run_here_when_idle``: WAL mode, checked at connect). Otherwise, and for
aiosqlite's own calls, the thread runs them, in order, as before.

The event loop must never wait for a lock, so the connection's busy
timeout is 0 and the thread sets its own around each call it runs. On the
event loop, SQLite's busy error (a lock another connection holds: another
process's writer, or one of this process's transactions holding it across
a wait, on the thread or between two statements) is not raised: what is
left of the call goes to the thread, from the statement that met it (which
had no effect), and waits there as before. ``executemany``'s sets of
parameters are a list, so the thread can send them again. In WAL mode a
writer holding the lock and any commit or rollback never wait; a reader
waits only for what a WAL reader waits for, which SQLite does itself
whatever the timeout (a checkpoint in another process restarting the log,
recovery after a crash: rare, and short). Outside a transaction only one
statement with one set of parameters runs on the event loop: there each
commits alone, and a lock found taken at the second could not send the
first again. What the event loop gives up: a long statement holds it for
its length (the store's statements are by key); a commit that checkpoints
the log writes the pages on it. And a caller cancelled while such a call
runs sees the cancellation once the call is done, as a caller cancelled
while the thread ran it did; but since a transaction's calls on the event
loop never suspend, a cancellation requested during an unshielded store
transaction is now usually seen after its commit (the store's public calls
run to their end anyway: roundtable/completion.py).

Close and connect are aiosqlite's own. This relies on aiosqlite's
``Connection`` constructor, queue, worker thread and ``_execute``, which is
why pyproject pins aiosqlite's minor version; ``tests/test_sqlite_driver.py``
checks the cursor's contract, ``tests/test_sqlite_on_the_event_loop.py``
where calls run and how a lock found taken is waited for.
"""

from __future__ import annotations

import contextlib
import sqlite3
from functools import partial
from queue import SimpleQueue
from threading import Thread
from typing import Any

import aiosqlite.core

_ITER_CHUNK_SIZE = 64  # aiosqlite's default; unused here (rows come all at once)
# The statements that open a transaction (the engine sends the first two).
_BEGINS = frozenset({"BEGIN", "BEGIN IMMEDIATE", "BEGIN DEFERRED", "BEGIN EXCLUSIVE"})


class OneTripCursor:
    """The part of aiosqlite's cursor SQLAlchemy's adapter uses."""

    def __init__(self, connection: OneTripConnection) -> None:
        self._connection = connection
        self._rows: list[Any] = []
        self.description: Any = None
        self.rowcount = -1
        self.lastrowid: int | None = None
        self.arraysize = 1

    def _reset(self) -> None:
        # Nothing of a previous statement outlives this one, even if it fails
        # (SQLAlchemy runs several statements on one cursor: insertmanyvalues,
        # the connect pragmas); as sqlite3's cursor, which resets these.
        self._rows = []
        self.description = None
        self.rowcount = -1

    def _run(self, method: str, sql: str, parameters: Any) -> None:
        """The statement, all its rows, and the cursor closed, so no
        statement is left half-stepped (a held-back BEGIN goes first: the
        connection's ``_begun``)."""
        self._reset()
        cursor = self._connection._conn.cursor()
        try:
            getattr(cursor, method)(sql, parameters)
            self.description = cursor.description
            self._rows = cursor.fetchall() if cursor.description else []
            self.rowcount = cursor.rowcount
            self.lastrowid = cursor.lastrowid
        except sqlite3.Error as error:
            rest = partial(self._run, method, sql, parameters)
            self._connection._wait_on_the_thread(error, rest, method)
            raise
        finally:
            cursor.close()

    async def execute(self, sql: str, parameters: Any = None) -> OneTripCursor:
        # None only, as aiosqlite: an empty dict stays a dict, so a statement
        # with named parameters fails with sqlite3's own message for it.
        if parameters is None:
            parameters = ()
        if not parameters and self._connection._hold_begin(sql):
            self._reset()
            return self
        await self._connection._execute(self._run, "execute", sql, parameters)
        return self

    async def executemany(self, sql: str, parameters: Any) -> OneTripCursor:
        # A list: a call handed to the thread after meeting a lock sends
        # its parameters again (an iterator would have lost those taken).
        await self._connection._execute(self._run, "executemany", sql, _listed(parameters))
        return self

    async def fetchall(self) -> list[Any]:
        rows, self._rows = self._rows, []
        return rows

    async def fetchone(self) -> Any:
        return self._rows.pop(0) if self._rows else None

    async def fetchmany(self, size: int | None = None) -> list[Any]:
        count = self.arraysize if size is None else size
        rows, self._rows = self._rows[:count], self._rows[count:]
        return rows

    async def close(self) -> None:
        self._rows = []

    async def __aenter__(self) -> OneTripCursor:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.close()


class OneTripConnection(aiosqlite.core.Connection):
    # A BEGIN not sent yet: it goes with the next statement.
    _begin: str | None = None
    # The thread is idle and its connection holds no transaction (see the
    # module's docstring for when this is known).
    _idle_outside_transaction = False
    # Calls queued for the thread so far: an end knows the state it found
    # only if nothing was queued after it.
    _queued = 0
    # The busy timeout the thread waits with, once the engine has let this
    # connection's calls run on the event loop (``run_here_when_idle``);
    # None: every call goes to the thread, as aiosqlite's own do.
    _busy_timeout_ms: int | None = None
    # Set while a call runs on the event loop.
    _here = False
    # Asked by the connection's borrower: SQLite refuses writes while a
    # reader has it. What was last sent (a new connection takes writes):
    # PRAGMA query_only goes only when the two differ (``_execute``).
    reading = False
    _query_only = False
    # Set while this driver sends its own busy timeout, the one PRAGMA a
    # reader's connection takes from it alone (``_reader_may``).
    _setting_timeout = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # aiosqlite's queue to its thread, replaced before the thread starts
        # by one that counts what the thread was handed and has finished,
        # whoever queued it (aiosqlite's own connect and stop queue theirs
        # directly).
        self._tx = _CountedQueue()
        self._thread = Thread(target=aiosqlite.core._connection_worker_thread, args=(self._tx,))

    def cursor(self) -> OneTripCursor:  # type: ignore[override]
        # No trip: the sqlite3 cursor is made per statement.
        return OneTripCursor(self)

    def run_here_when_idle(self, busy_timeout_ms: int) -> None:
        """Let this module's calls run on the event loop while the thread
        is idle (the module's docstring says when, and why that is safe);
        the connection's busy timeout must be 0 from now on, and the thread
        waits ``busy_timeout_ms`` for a lock, as before. For a database in
        WAL mode only: there a writer's statements and any commit never
        wait for a lock, and a reader waits only for what a reader waits
        for, which the event loop refuses and the thread waits for."""
        self._busy_timeout_ms = busy_timeout_ms

    async def _execute(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        # Forgotten before anything is queued: a call cancelled or failed
        # leaves the thread's state unknown.
        self._idle_outside_transaction = False
        self._queued += 1
        begin = self._take_begin()
        here = self._may_run_here(fn, args, begin)
        call = partial(fn, *args, **kwargs)
        if begin is not None:
            # The held BEGIN goes first, in the call's trip, so the call runs
            # inside the transaction, as it did when the BEGIN was sent at
            # once (aiosqlite's own calls too: execute, executemany, ...; left
            # held, such a call ran outside it, in autocommit, and a rollback
            # finding only the BEGIN sent nothing).
            call = partial(self._begun, begin, call)
        if self.reading != self._query_only and not self._closing(fn):
            # Before anything, the BEGIN too (SQLite refuses BEGIN IMMEDIATE
            # under query_only), in the same trip.
            call = partial(self._query_only_then, self.reading, call)
        if here:
            self._here = True
            try:
                return call()
            except _WaitOnTheThread as busy:
                call = busy.rest  # what is left, after what already ran
            finally:
                self._here = False
        return await super()._execute(self._on_the_thread, call)

    def _may_run_here(self, fn: Any, args: tuple[Any, ...], begin: str | None) -> bool:
        """Whether a call may run on the event loop now: one of this
        module's, on a connection the engine allowed it on, whose thread is
        idle (nothing of it is running or queued). Outside a transaction
        only one statement with one set of parameters may: each commits on
        its own there, so a lock found taken at the second could not send
        the first again."""
        if (
            self._busy_timeout_ms is None
            or not self._running
            or self._connection is None
            or self._tx.handed != self._tx.finished
        ):
            return False
        function = getattr(fn, "__func__", None)
        if function is OneTripConnection._ended:
            return True
        if begin is not None or self._connection.in_transaction:
            return function in _RUN_HERE
        if function is OneTripConnection._steps:
            return len(args[0]) == 1 and args[0][0][0] == "execute"
        return function is OneTripCursor._run and args[0] == "execute"

    def _on_the_thread(self, call: Any) -> Any:
        """On the thread: the call, with the busy timeout it waits for a lock
        with (0 while the event loop may run calls: it must never wait)."""
        if self._busy_timeout_ms is None:
            return call()
        with contextlib.suppress(sqlite3.Error):
            self._busy_timeout(self._busy_timeout_ms)
        try:
            return call()
        finally:
            if self._connection is not None:
                with contextlib.suppress(sqlite3.Error):
                    self._busy_timeout(0)

    def _busy_timeout(self, ms: int) -> None:
        """The connection's busy timeout, set by this driver (a reader's
        connection refuses it from anyone else: ``_reader_may``)."""
        self._setting_timeout = True
        try:
            self._conn.execute(f"PRAGMA busy_timeout = {ms}")
        finally:
            self._setting_timeout = False

    def _wait_on_the_thread(self, error: sqlite3.Error, rest: Any, method: str = "") -> None:
        """On the event loop, a lock found taken (SQLite's busy error: the
        statement that meets it has no effect) leaves ``rest`` to the
        thread, where it waits for the lock as before. Any other error, or
        anything on the thread, is the caller's to raise. So is a lock met
        by ``executemany`` outside a transaction: each set of parameters
        commits alone there, and those before it cannot be sent again
        (inside one, the lock is taken at the first set, and kept)."""
        code = getattr(error, "sqlite_errorcode", None)
        if not self._here or code is None or code & 0xFF != sqlite3.SQLITE_BUSY:
            return
        if method == "executemany" and not self._conn.in_transaction:
            return
        raise _WaitOnTheThread(rest) from error

    def _closing(self, fn: Any) -> bool:
        """Whether ``fn`` is aiosqlite's close of this connection: closed as
        it is (a statement sent first and failing would leave it open)."""
        connection = self._connection
        return (
            connection is not None
            and getattr(fn, "__self__", None) is connection
            and getattr(fn, "__name__", None) == "close"
        )

    def _query_only_then(self, on: bool, call: Any) -> Any:
        """SQLite told to refuse writes (``on``) or take them again, then
        the call. ``query_only`` lets a PRAGMA and ATTACH through (a reader
        could take the file out of WAL mode, or turn the refusal off), so a
        reader's connection also refuses those (:func:`_reader_may`). Known
        sent once it ran: a call whose statement then waits on the thread
        (``_WaitOnTheThread``) leaves only its rest there."""
        if on:
            self._conn.execute("PRAGMA query_only = 1")
            self._conn.set_authorizer(self._reader_may)
        else:
            self._conn.set_authorizer(None)
            self._conn.execute("PRAGMA query_only = 0")
            if self._here and self._busy_timeout_ms is not None:
                # On the event loop the timeout must be 0 (a reader's bug
                # could have left another: a writer would wait on the loop).
                # On the thread, _on_the_thread sets it around the call.
                self._busy_timeout(0)
        self._query_only = on
        return call()

    def _reader_may(self, action: int, name: str | None, *_rest: Any) -> int:
        """What a reader's connection lets SQLite prepare: anything
        ``query_only`` lets through (every read), but no ATTACH or DETACH,
        and no PRAGMA but SQLAlchemy's ``read_uncommitted`` (its isolation
        level, set and reset when a borrower asks for one, AUTOCOMMIT say)
        and this driver's own busy timeout. Asked when SQLite prepares a
        statement, not at each run: sqlite3 keeps prepared statements by
        their text, so a reader sending this driver's very text after it
        reuses its statement (both texts set values this driver sets; a
        writer lent the connection next has its timeout set to 0 again).
        Reflection (``PRAGMA table_info``...) through a reader is refused
        too: the store reflects, migrates and checks its schema through the
        writers' engine."""
        if action in (sqlite3.SQLITE_ATTACH, sqlite3.SQLITE_DETACH):
            return sqlite3.SQLITE_DENY
        if action != sqlite3.SQLITE_PRAGMA:
            return sqlite3.SQLITE_OK
        pragma = (name or "").lower()
        if pragma == "read_uncommitted" or (pragma == "busy_timeout" and self._setting_timeout):
            return sqlite3.SQLITE_OK
        return sqlite3.SQLITE_DENY

    def _begun(self, begin: str, call: Any) -> Any:
        """The held-back BEGIN, then the call."""
        try:
            self._open(begin)
        except sqlite3.Error as error:
            self._wait_on_the_thread(error, partial(self._begun, begin, call))
            raise
        return call()

    def _open(self, begin: str) -> None:
        """A held-back BEGIN, sent at last (where a writer waits for
        SQLite's write lock, on the thread)."""
        self._conn.execute(begin)

    def _steps(
        self, steps: list[tuple[str, str, Any]], commit: bool = False
    ) -> tuple[list[tuple[Any, list[Any], int]], bool]:
        """On the thread: each statement in its order, with every row of
        each, then (with ``commit``) the commit; each one's (description,
        rows, row count), and whether a transaction is open after them. A
        statement that fails stops the rest, the commit too; its error
        carries its index as ``step`` (the commit's: ``len(steps)``)."""
        return self._steps_from(steps, commit, 0, [])

    def _steps_from(
        self,
        steps: list[tuple[str, str, Any]],
        commit: bool,
        start: int,
        done: list[tuple[Any, list[Any], int]],
    ) -> tuple[list[tuple[Any, list[Any], int]], bool]:
        """:meth:`_steps` from step ``start`` on, after ``done`` (a lock
        found taken on the event loop leaves the rest to the thread)."""
        for index in range(start, len(steps)):
            method, sql, parameters = steps[index]
            cursor = self._conn.cursor()
            try:
                getattr(cursor, method)(sql, parameters)
                rows = cursor.fetchall() if cursor.description else []
                done.append((cursor.description, rows, cursor.rowcount))
            except sqlite3.Error as error:
                rest = partial(self._steps_from, steps, commit, index, done)
                self._wait_on_the_thread(error, rest, method)
                error.step = index  # type: ignore[attr-defined]
                raise
            finally:
                cursor.close()
        if commit:
            try:
                self._conn.commit()
            except sqlite3.Error as error:
                rest = partial(self._steps_from, steps, commit, len(steps), done)
                self._wait_on_the_thread(error, rest)
                error.step = len(steps)  # type: ignore[attr-defined]
                raise
        return done, self._conn.in_transaction

    async def run_steps(
        self, steps: list[tuple[str, str, Any]], commit: bool = False
    ) -> list[tuple[Any, list[Any], int]]:
        """Several statements in one trip (a held BEGIN first, as with any
        call), with ``commit`` the transaction's commit after them; see
        :meth:`_steps`. Statements sent outside a transaction (a lone read,
        in SQLite's autocommit), or committed, leave the connection known
        idle outside one, by the rule of :meth:`_end`, so the pool's
        rollback after them is not sent."""
        queued = self._queued
        steps = [
            (method, sql, _listed(parameters) if method == "executemany" else parameters)
            for method, sql, parameters in steps
        ]
        done, still_open = await self._execute(self._steps, steps, commit)
        self._idle_outside_transaction = not still_open and self._queued == queued + 1
        return done

    @property
    def known_idle(self) -> bool:
        """Known idle outside a transaction (the module's docstring says
        when), nothing queued for the thread or running on it."""
        return self._idle_outside_transaction and self._tx.handed == self._tx.finished

    def _hold_begin(self, sql: str) -> bool:
        """Hold a BEGIN back for the next statement, if nothing can differ."""
        if not self._idle_outside_transaction or sql.strip().upper() not in _BEGINS:
            return False
        self._begin = sql
        self._idle_outside_transaction = False
        return True

    def _take_begin(self) -> str | None:
        begin, self._begin = self._begin, None
        return begin

    def _ended(self, end: str) -> bool:
        """Commit or roll back; whether a transaction is still open (it is,
        if the commit failed)."""
        try:
            getattr(self._conn, end)()
        except sqlite3.Error as error:
            self._wait_on_the_thread(error, partial(self._ended, end))
            raise
        return self._conn.in_transaction

    async def _end(self, end: str) -> None:
        if self._take_begin() is not None:
            # BEGIN and nothing else: nothing was sent, nothing to end.
            self._idle_outside_transaction = True
            return
        queued = self._queued
        still_open = await self._execute(self._ended, end)
        # Known only if nothing was queued after this end (another task on
        # this connection, say, whose BEGIN ran behind it): that call's
        # effect on the transaction is not known here.
        self._idle_outside_transaction = not still_open and self._queued == queued + 1

    async def commit(self) -> None:
        await self._end("commit")

    async def rollback(self) -> None:
        if self._idle_outside_transaction:
            return  # nothing to roll back, and the thread is idle
        await self._end("rollback")

    async def close(self) -> None:
        self._begin = None
        self._idle_outside_transaction = False
        await super().close()


def _listed(parameters: Any) -> Any:
    """``executemany``'s sets of parameters, as a sequence that can be sent
    twice (an iterator, once handed over, had lost the sets it gave)."""
    return parameters if isinstance(parameters, list | tuple) else list(parameters)


class _CountedQueue(SimpleQueue):  # type: ignore[type-arg]
    """A queue to a connection's thread that counts the calls put in it
    (by the event loop) and those the thread has finished (by the thread):
    the thread is idle when the two are equal."""

    def __init__(self) -> None:
        self.handed = 0
        self.finished = 0

    def put_nowait(self, item: tuple[Any, Any]) -> None:
        future, function = item
        self.handed += 1
        super().put_nowait((future, partial(self._finishing, function)))

    def put(self, item: tuple[Any, Any], block: bool = True, timeout: float | None = None) -> None:
        self.put_nowait(item)

    def _finishing(self, function: Any) -> Any:
        try:
            return function()
        finally:
            self.finished += 1


class _WaitOnTheThread(Exception):
    """A call on the event loop met a lock taken: ``rest`` goes to the thread."""

    def __init__(self, rest: Any) -> None:
        super().__init__("SQLite's lock is taken: the thread waits for it")
        self.rest = rest


# The calls that may run on the event loop inside a transaction (and, one
# statement long, outside one): this module's own.
_RUN_HERE = frozenset({OneTripConnection._steps, OneTripCursor._run})


def run_here_when_idle(dbapi_connection: Any, busy_timeout_ms: int) -> bool:
    """For the engine's connect listener, given SQLAlchemy's adapter over
    a connection in WAL mode whose busy timeout it set to 0: let this
    module's calls on it run on the event loop while its thread is idle
    (:meth:`OneTripConnection.run_here_when_idle`). False for a connection
    of another driver, left as it is."""
    driver = getattr(dbapi_connection, "_connection", None)
    if not isinstance(driver, OneTripConnection):
        return False
    driver.run_here_when_idle(busy_timeout_ms)
    return True


def connect(database: str, **kwargs: Any) -> OneTripConnection:
    """As ``aiosqlite.connect``, for SQLAlchemy's ``async_creator_fn``: it
    receives the arguments the dialect would have given aiosqlite. The
    connection is used from the event loop too, never while its thread
    runs a call (``_may_run_here``), hence ``check_same_thread``."""
    kwargs["check_same_thread"] = False
    connection = OneTripConnection(partial(sqlite3.connect, database, **kwargs), _ITER_CHUNK_SIZE)
    # As SQLAlchemy does for aiosqlite's own: the thread must not keep a
    # process alive that forgot to dispose of its engine.
    connection._thread.daemon = True
    return connection
