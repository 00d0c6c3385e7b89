"""Memory: a worker's resident memory per run waiting for approval.

Each side's worker is restarted (an empty cache) and warmed with a few runs
that finish; then ``runs`` runs are started that stay waiting: ours with one
write waiting for approval, bare waiting for its update. Each worker keeps
them all in its workflow cache (the SDK keeps up to 1,000). The growth of the
worker's VmRSS, divided by the runs, is the cost of one waiting run.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from sqlalchemy import func, select

from bench import bare
from bench.approvals import ONE_WRITE
from bench.stack import BARE, OURS, Stack, rss_kib
from bench.throughput import WORKER_ENV, run_bare, run_ours
from roundtable.models import RunInput, WorkflowArgs
from roundtable.names import RUN_WORKFLOW
from roundtable.store import Store
from roundtable.store.schema import ApprovalRow

SETTLE_SECONDS = 2.0  # let the worker's allocations settle before reading memory


async def _pending(store: Store) -> int:
    """Approvals pending: counted, not listed (a list of a thousand rows every
    half second took CPU from the workers it was waiting for)."""
    query = select(func.count()).select_from(ApprovalRow).where(ApprovalRow.status == "pending")
    async with store.db.snapshot() as session:
        return int((await session.execute(query)).scalar_one())


async def _ours_waiting(stack: Stack, runs: int) -> None:
    client, store = stack.ours_client, stack.store
    assert client is not None and store is not None
    before = await _pending(store)
    for start in range(0, runs, 100):  # in chunks: the server's own limits
        batch = []
        for _ in range(min(100, runs - start)):
            key = f"wait-{uuid.uuid4().hex[:12]}"
            request = RunInput(run_id=key, task_text="bench", seats=["seat-1"], script=ONE_WRITE)
            batch.append(
                client.start_workflow(
                    RUN_WORKFLOW, WorkflowArgs(request=request), id=key, task_queue=OURS
                )
            )
        await asyncio.gather(*batch)
    deadline = time.monotonic() + 600
    while await _pending(store) < before + runs:
        if time.monotonic() > deadline:
            raise AssertionError("our runs never all waited for approval")
        await asyncio.sleep(0.5)


POLLS = 1200  # a run not waiting after this many polls, 0.2 s apart, fails the figure


async def until_waiting(handle: Any) -> None:
    """Until the run says, by its ``waiting`` query, that it waits for its
    decision (bare's approval answers so at once; bench/memory_floor.py's
    shaped run once its history is in place)."""
    for _ in range(POLLS):
        if await handle.query("waiting", result_type=bool):
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"run {handle.id} never waited for its decision")


async def bare_waiting(
    stack: Stack, runs: int, workflow: str = bare.WORKFLOW, argument: str = ""
) -> None:
    """``runs`` of one of bare's workflows (``argument``, or when empty each
    run's own key), all waiting for their decision."""
    client = stack.bare_client
    assert client is not None
    handles = []
    for start in range(0, runs, 100):
        batch = []
        for _ in range(min(100, runs - start)):
            key = f"wait-bare-{uuid.uuid4().hex[:12]}"
            batch.append(client.start_workflow(workflow, argument or key, id=key, task_queue=BARE))
        handles += await asyncio.gather(*batch)
    for start in range(0, runs, 50):
        await asyncio.gather(*(until_waiting(h) for h in handles[start : start + 50]))


async def _warm(stack: Stack) -> None:
    """A few runs that finish, so imports and pools are in place before the baseline."""
    await run_bare(stack, 3)
    await run_ours(stack, 3)


async def measure(stack: Stack, runs: int) -> dict[str, Any]:
    stack.restart_ours(WORKER_ENV)
    stack.restart_bare()
    await asyncio.sleep(3)  # both polling
    await _warm(stack)
    await asyncio.sleep(SETTLE_SECONDS)
    pids = stack.pids()
    before = {side: rss_kib(pid) for side, pid in pids.items()}
    await bare_waiting(stack, runs)
    await _ours_waiting(stack, runs)
    await asyncio.sleep(SETTLE_SECONDS)
    grown = {side: rss_kib(pid) - before[side] for side, pid in pids.items()}
    figures: dict[str, Any] = {"runs_waiting": runs}
    for side in ("bare", "ours"):
        figures[side] = {"kib_per_run": round(grown[side] / runs, 1)}
    figures["ratio"] = (
        round(figures["ours"]["kib_per_run"] / figures["bare"]["kib_per_run"], 2)
        if figures["bare"]["kib_per_run"] > 0
        else None
    )
    return figures
