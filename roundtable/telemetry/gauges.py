"""The gauges, recounted in the database while a worker runs.

A count kept in memory would be wrong after a restart and would differ
between workers; the database's count is the same for all of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from roundtable.store import Store
from roundtable.telemetry.metrics import Metrics

log = logging.getLogger("roundtable.metrics")


async def recount(store: Store, metrics: Metrics) -> None:
    pending, unknown = await store.open_work()
    metrics.gauges(pending, unknown)


async def _recount_every(store: Store, metrics: Metrics, seconds: float) -> None:
    while True:
        try:
            await recount(store, metrics)
        except Exception as exc:  # a database blip: the next round tries again
            log.warning("metrics recount failed: %s", exc)
        await asyncio.sleep(seconds)


@contextlib.asynccontextmanager
async def recounting(store: Store, metrics: Metrics, seconds: float | None) -> AsyncIterator[None]:
    """Recount every ``seconds`` (first at once) until the block ends; None: never."""
    if seconds is None:
        yield
        return
    task = asyncio.create_task(_recount_every(store, metrics, seconds))
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
