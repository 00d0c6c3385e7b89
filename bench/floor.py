"""What an approval costs at least, beside bare and ours:

    .venv/bin/python -m bench.floor [--approvals N]

Issue 12 asks the decision call and the write recorded to stay within 1.5x
bare Temporal, whose update records nothing, and our worker's CPU per
approval within 2x. Two sides in between, both on bare's worker:

- ``durable`` (``bare.DurableApproval``) is the least a safe approval can
  do. A decision that must survive the worker (ours: decided once, under
  the run lock, before the call returns) needs at least a local activity
  and one database transaction inside the update; a write under a lease
  needs at least a claim and a recorded outcome around the write. It is
  exactly that: one-statement SQLite transactions, no checks, no audit, no
  codec.
- ``shaped`` (``bare.ShapedApproval``) is our one-write run as Temporal
  sees it, from its start to its result, with none of our code: the same
  local activities, activities, upserts, timer and update, payloads of
  ours' sizes, and bare's one-row write. What the run's shape costs, with
  no store, codec or checks.

Timed as bench/approvals.py times bare and ours (runs started 20 a side at
once, then decided one at a time, all four sides alternating), with each
worker's CPU (``/proc``) over each side's whole runs; prints medians and
ratios to bare. Not part of `make bench` (a one-off measurement of what no
design of this kind can go under); bench/README.md quotes it.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from temporalio.api.enums.v1 import EventType

from bench import approvals, bare
from bench.stack import BARE, Stack, cpu_seconds, stack


async def durable_waiting(made: Stack) -> Any:
    return await approvals.bare_waiting(made, bare.DURABLE)


async def durable_decided(made: Stack, handle: Any) -> dict[str, float]:
    return await approvals.bare_decided(made, handle, bare.recorded_at)


async def shaped_waiting(made: Stack) -> Any:
    """A shaped run started and waiting for its decision."""
    assert made.bare_client is not None
    key = f"shaped-{uuid.uuid4().hex[:12]}"
    handle = await made.bare_client.start_workflow(
        bare.SHAPED_APPROVAL, key, id=key, task_queue=BARE
    )
    await _asking(handle)
    return handle


async def _asking(handle: Any, within: float = 30) -> None:
    """Until the shaped run waits for its decision, as ours does when decided."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if await handle.query("waiting", result_type=bool):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{handle.id} never waited for its decision")


# Workflow tasks come and go with timing (a local activity that outlasts its
# task adds one); the commands each history records must not.
_TASK_EVENTS = {
    EventType.EVENT_TYPE_WORKFLOW_TASK_SCHEDULED,
    EventType.EVENT_TYPE_WORKFLOW_TASK_STARTED,
    EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED,
}


def shape(history: Any) -> list[str]:
    """A history's events without its workflow tasks': what the run did."""
    kinds = [event.event_type for event in history.events]
    return [EventType.Name(kind) for kind in kinds if kind not in _TASK_EVENTS]


async def same_shape(made: Stack) -> int:
    """Refuses unless a shaped run, decided, did what one of ours did;
    its number of events (ours' without their workflow tasks')."""
    waiting = await approvals.ours_waiting(made)
    await approvals.ours_decided(made, waiting)
    ours = shape(await waiting[0].fetch_history())
    handle = await shaped_waiting(made)
    await approvals.bare_decided(made, handle)
    shaped = shape(await handle.fetch_history())
    if shaped != ours:
        raise AssertionError(f"the shaped run is not ours: {shaped} against {ours}")
    return len(shaped)


# Each side: its run started and waiting, that run decided, and the worker
# that serves it.
SIDES: dict[str, tuple[Callable[[Stack], Awaitable[Any]], Callable[..., Awaitable[Any]], str]] = {
    "bare": (approvals.bare_waiting, approvals.bare_decided, "bare"),
    "durable": (durable_waiting, durable_decided, "bare"),
    "shaped": (shaped_waiting, approvals.bare_decided, "bare"),
    "ours": (approvals.ours_waiting, approvals.ours_decided, "ours"),
}


async def measure(count: int) -> dict[str, dict[str, float]]:
    """Median seconds by side and figure, and each side's worker CPU a run.
    As bench/approvals.py does it: runs started a batch at once, then
    decided one at a time, the sides alternating. Three sides share bare's
    worker, so its CPU is read around each side's starts and each decision
    apart."""
    async with stack() as made:
        pids = made.pids()
        print(f"the shaped run did what ours did: the same {await same_shape(made)} events")
        for waiting, decided, _ in SIDES.values():  # warm each side up
            await decided(made, await waiting(made))
        timed: dict[str, list[dict[str, float]]] = {side: [] for side in SIDES}
        cpu = dict.fromkeys(SIDES, 0.0)

        async def spending(side: str, work: Awaitable[Any]) -> Any:
            worker = pids[SIDES[side][2]]
            before = cpu_seconds(worker)
            done = await work
            cpu[side] += cpu_seconds(worker) - before
            return done

        for start in range(0, count, approvals.BATCH):
            size = min(approvals.BATCH, count - start)
            batch = {
                side: await spending(side, asyncio.gather(*(w(made) for _ in range(size))))
                for side, (w, _, _) in SIDES.items()
            }
            for index in range(size):
                for side, (_, decided, _) in SIDES.items():
                    timed[side].append(await spending(side, decided(made, batch[side][index])))
    medians = {
        side: {figure: statistics.median(t[figure] for t in runs) for figure in runs[0]}
        for side, runs in timed.items()
    }
    for side, spent in cpu.items():
        medians[side]["cpu"] = spent / count
    return medians


def _ratio(value: float, base: float) -> str:
    """``value`` against bare's; none when bare's is zero, as its CPU can be
    over a handful of approvals (the kernel counts CPU in 10 ms ticks)."""
    return f"{value / base:.2f}" if base else "bare measured 0: no ratio"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--approvals", type=int, default=100)
    medians = asyncio.run(measure(parser.parse_args().approvals))
    labels = [*approvals.FIGURES, ("cpu", "worker CPU per approval (the whole run)")]
    for figure, label in labels:
        base = medians["bare"][figure]
        shown = [
            f"{side} {1000 * m[figure]:.1f} ms ({_ratio(m[figure], base)})"
            for side, m in medians.items()
        ]
        print(f"{label}, p50: " + ", ".join(shown))


if __name__ == "__main__":
    main()
