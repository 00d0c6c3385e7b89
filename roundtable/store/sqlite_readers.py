"""SQLite's reader connections, kept out of the pool between reads.

Every lone read on a run's path (a run by id, an action by its idempotency
key, the writes waiting on a target) took a connection from SQLAlchemy's
pool and gave it back: the AsyncConnection built, the greenlet hops, the
pool's bookkeeping and events, the shielded close's turns of the event loop.
That cost about twice the read itself (0.14 to 0.24 ms of this process's
CPU against 0.03 to 0.08 ms on a connection kept: bench/README, "What was
cut"), four times an approved write. The writers already keep one connection
(sqlite_core.HeldConnection); readers run concurrently, so here a few idle
ones are kept, and each is lent to one reading block at a time.

The rules are the writers' held connection's:
- A connection is kept only if its block left it known idle outside a
  transaction (the driver's own rule: a lone read in SQLite's autocommit, or
  a deferred transaction rolled back). Anything else (a block cancelled
  while a call ran on SQLite's thread, a rollback that failed) goes back to
  the pool, whose reset rolls it back.
- Taking one afresh, letting one go and closing run to their end whatever
  cancels their caller: a connection taken for a caller cancelled meanwhile
  is kept on the same terms as any other (room left, the store open, its
  pool still the engine's) or let go, never lost; a close cut half-way
  still lets every idle one go. Only an event loop's teardown, which cancels
  every task (``to_completion``'s own too), can cut a let-go: what it
  leaves is idle outside any transaction, and the process exits
  (docs/architecture.md).
- Never so many that the pool could lend nobody else one: at most
  ``READERS_KEPT`` idle, and two fewer than the pool's size (the writers'
  connection, and one for everything else); a pool of two or fewer keeps
  none, as does a pool that shares or never keeps its connections.
- Closing gives back the idle ones at once; one in use goes back at the
  end of its block. A connection from a pool the engine has since replaced
  (disposed of) is closed, not returned (the new pool would never close it).
- A kept connection is idle outside any transaction, so it holds no WAL
  snapshot: the next read on it sees every commit made meanwhile, and it
  never holds back a checkpoint.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from sqlalchemy.pool import QueuePool

from roundtable.completion import to_completion, waited_out
from roundtable.store import sqlite_core
from roundtable.store.sqlite_driver import OneTripConnection

# Idle reader connections kept at most: a worker's reads are short, and few
# run at the same instant; each kept one is one the pool cannot lend others.
READERS_KEPT = 3

# A kept connection, the pool it came from, and whether it is fresh from
# that pool (taken for a caller, not lent yet: the pool's reset left it
# outside any transaction, which its driver learns at its first call).
_Kept = tuple[AsyncConnection, OneTripConnection, Any, bool]
# One lent to a reading block: the connection, its driver and its pool.
Lent = tuple[AsyncConnection, OneTripConnection, Any]


class HeldReaders:
    def __init__(self, engine: AsyncEngine, most: int = READERS_KEPT) -> None:
        self._engine = engine
        # The last given back is lent first: its caches are warm (as the
        # pool's LIFO).
        self._idle: list[_Kept] = []
        pool = engine.sync_engine.pool
        self._most = max(0, min(most, pool.size() - 2)) if isinstance(pool, QueuePool) else 0
        # Set by close: nothing is kept from then on.
        self.closed = False

    @property
    def drivers(self) -> list[OneTripConnection]:
        """The idle connections kept now, by their drivers."""
        return [driver for _pooled, driver, _source, _fresh in self._idle]

    def lendable(self, driver: OneTripConnection) -> bool:
        """Whether a kept connection may be lent as it is: fresh from the
        pool, or left known idle outside a transaction by its last block."""
        return any(d is driver and (fresh or d.known_idle) for _p, d, _s, fresh in self._idle)

    async def take(self) -> Lent | None:
        """A kept connection, or one taken from the pool to be kept after
        its block, with the pool it came from (for :meth:`give_back`); None
        where nothing is kept (the caller then reads on a connection of the
        pool's, as before)."""
        if self.closed or self._most == 0:
            return None
        lent = await self._idle_one()
        return lent if lent is not None else await self._take_afresh()

    async def _idle_one(self) -> Lent | None:
        """The last kept connection still fit to lend, letting go of those
        that are not (from a pool since disposed of, or left in a state not
        known)."""
        pool = self._engine.sync_engine.pool
        while self._idle:
            # Popped before any await: no two blocks are lent one connection.
            pooled, driver, source, fresh = self._idle.pop()
            usable = source is pool and not (pooled.closed or pooled.invalidated)
            if usable and (fresh or driver.known_idle):
                return pooled, driver, source
            await self._let_go(pooled, driver, source)
        return None

    async def _take_afresh(self) -> Lent | None:
        """One connection from the pool, for the caller. Taken whole
        whatever cancels the caller meanwhile (as the writers' is); a caller
        gone by then leaves it kept only as any other would be
        (:meth:`_keep_or_let_go`) (review: put among the idle first, a
        connection outlived a close, and cancelled takes kept more than the
        pool could spare)."""
        taking = asyncio.ensure_future(self._connect())
        if await waited_out(taking):
            failed = taking.exception()
            if failed is not None:  # the cancellation wins, as to_completion's does
                raise asyncio.CancelledError() from failed
            lent = taking.result()
            if lent is not None:  # never used: fresh as the pool's reset left it
                await self._keep_or_let_go(lent, fresh=True)
            raise asyncio.CancelledError()
        return taking.result()

    async def _connect(self) -> Lent | None:
        pool = self._engine.sync_engine.pool
        pooled = await self._engine.connect()
        driver = (await pooled.get_raw_connection()).driver_connection
        if not isinstance(driver, OneTripConnection):
            await pooled.close()
            self._most = 0  # another driver's engine: nothing is kept
            return None
        return pooled, driver, pool

    async def give_back(self, lent: Lent) -> None:
        """At a reading block's end: kept if the block left it known idle
        outside a transaction, its pool is still the engine's and there is
        room; else let go."""
        await self._keep_or_let_go(lent, fresh=False)

    async def _keep_or_let_go(self, lent: Lent, fresh: bool) -> None:
        """``fresh``: taken for a caller that is gone, never used (the
        pool's reset left it outside any transaction), so its driver need
        not know it idle yet."""
        pooled, driver, source = lent
        kept = source is self._engine.sync_engine.pool and not self.closed
        kept = kept and not (pooled.closed or pooled.invalidated)
        if kept and (fresh or driver.known_idle) and len(self._idle) < self._most:
            self._idle.append((pooled, driver, source, fresh))
            return
        await self._let_go(pooled, driver, source)

    @to_completion
    async def _let_go(
        self, pooled: AsyncConnection, driver: OneTripConnection, source: Any
    ) -> None:
        await sqlite_core.let_go(self._engine, pooled, driver, source)

    def close(self) -> Awaitable[None]:
        """Keep nothing from now on: the idle ones go back now, those in use
        at the end of their blocks (not waited for). Marked closed and the
        idle ones taken at the call, before anything can cancel it, then let
        go to their end whatever cancels the caller (review: an event loop's
        teardown, cancelling every task, cut a close that had not begun). The
        returned task is under way already."""
        self.closed = True
        idle, self._idle = self._idle, []
        # A task at once: it lets them go even if nothing awaits it.
        return asyncio.ensure_future(_let_all_go(self, idle))


@to_completion
async def _let_all_go(readers: HeldReaders, idle: list[_Kept]) -> None:
    """Each of ``idle`` let go, the rest too when one's let-go is cut off
    (the event loop's teardown cancels the let-go's own task as well)."""
    cut: BaseException | None = None
    for pooled, driver, source, _fresh in idle:
        try:
            await readers._let_go(pooled, driver, source)
        except asyncio.CancelledError as error:
            cut = error
    if cut is not None:
        raise cut
