"""The sweep's gate, both ways, through the worker's own start-up on the dev
server: disabled, a worker creates no schedule and pauses one that exists;
enabled again, a worker resumes it."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import uuid
from collections.abc import Iterator

import pytest
from temporalio.service import RPCError

from roundtable.config import Settings
from roundtable.names import SWEEP_SCHEDULE_ID
from roundtable.temporal import data_converter
from tests.temporal_servers import start_dev_server
from worker import run_worker
from workflows import search_attributes


async def start_and_stop_a_worker(settings: Settings) -> None:
    ready = asyncio.Event()
    running = asyncio.create_task(run_worker(settings, ready))
    await asyncio.wait(
        {running, asyncio.create_task(ready.wait())}, return_when=asyncio.FIRST_COMPLETED
    )
    assert ready.is_set(), running.exception() if running.done() else "worker not ready"
    assert gc.get_threshold() == settings.gc_thresholds()  # the process's collector, tuned
    assert gc.get_freeze_count() > 0  # what it held before polling, set aside
    running.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await running


@pytest.fixture
def pythons_own_collector() -> Iterator[None]:
    """The worker tunes the whole process's collector and freezes what it
    holds: this one's, put back."""
    before, frozen = gc.get_threshold(), gc.get_freeze_count()
    yield
    gc.set_threshold(*before)
    if frozen == 0:
        gc.unfreeze()


async def test_the_sweep_gate_pauses_and_resumes_the_schedule(
    tmp_path, pythons_own_collector
) -> None:
    env = await start_dev_server(
        search_attributes=list(search_attributes.ALL), data_converter=data_converter()
    )
    try:
        base = Settings(
            database_url=f"sqlite+aiosqlite:///{tmp_path / 'rt.db'}",
            temporal_address=env.client.service_client.config.target_host,
            task_queue=f"gate-{uuid.uuid4().hex[:8]}",
            worker_metrics_address="",
            worker_gc_thresholds="12345,6,7",
        )
        schedule = env.client.get_schedule_handle(SWEEP_SCHEDULE_ID)

        async def paused() -> bool | None:
            try:
                return (await schedule.describe()).schedule.state.paused
            except RPCError:
                return None  # no schedule

        await start_and_stop_a_worker(base.model_copy(update={"sweep_enabled": False}))
        assert await paused() is None  # disabled: none is created

        await start_and_stop_a_worker(base)
        assert await paused() is False  # enabled: created and running

        await start_and_stop_a_worker(base.model_copy(update={"sweep_enabled": False}))
        assert await paused() is True  # disabled: the existing one is paused
        description = await schedule.describe()
        assert "ROUNDTABLE_SWEEP_ENABLED=false" in description.schedule.state.note

        await start_and_stop_a_worker(base)
        assert await paused() is False  # enabled again: resumed
    finally:
        await env.shutdown()
