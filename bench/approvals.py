"""The approval round trip, the worker CPU per approval and the history one
approved write costs, Roundtable against bare Temporal (bench/bare.py).

Bare and ours alternate, one approval each in turn, so the machine's noise
falls on both. Timed from the decision call to (a) the decision call
returning, (b) the write committed (the row's own timestamp; ours: the
action's ``finished_at``), (c) the workflow's result. Each worker serves its
own side only, so its CPU over the loop, divided by the approvals, is the
CPU one approval costs (ours: the whole one-write run; bare: its workflow).

The runs are started a batch at a time and decided once all of them wait,
one decision at a time: each decision still meets an idle worker, and the
loop no longer waits out every run's start in turn (about a third of
`make bench`'s approvals figure).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Sequence
from datetime import UTC
from pathlib import Path
from typing import Any

from bench import bare
from bench.stack import BARE, OURS, Stack, cpu_seconds, sampled, summary
from roundtable import operations
from roundtable.models import RunInput, WorkflowArgs
from roundtable.names import RUN_WORKFLOW
from roundtable.permissions import Decider

ONE_WRITE = {
    "turns": [
        {
            "seat": "seat-1",
            "round": 1,
            "text": "updating",
            "tool_calls": [
                {
                    "name": "ticket_update",
                    "args": {"tenant_id": "acme", "ticket_id": "T-1", "fields": {"p": "high"}},
                }
            ],
        }
    ],
    "final": "done",
}
NO_WRITE = {"turns": [{"seat": "seat-1", "round": 1, "text": "nothing to do"}], "final": "done"}
# Runs a side started at once, then decided one by one.
BATCH = 20
FIGURES = (
    ("update", "decision call returns"),
    ("write", "decide → write recorded"),
    ("result", "decide → workflow result"),
    ("pickup", "of which the server's wait for a worker"),
)


Timings = dict[str, float]
# A run of ours waiting for approval: its handle, its approval, its action.
Waiting = tuple[Any, dict[str, Any], dict[str, Any]]


async def bare_waiting(stack: Stack, workflow: str = bare.WORKFLOW) -> Any:
    """A bare ``workflow`` started and idle, waiting for its update."""
    assert stack.bare_client is not None
    key = f"bare-{uuid.uuid4().hex[:12]}"
    handle = await stack.bare_client.start_workflow(workflow, key, id=key, task_queue=BARE)
    await _waiting(handle)  # as ours is when decided: idle, waiting for the update
    return handle


async def bare_decided(
    stack: Stack,
    handle: Any,
    recorded: Callable[[str, str], float | None] = bare.written_at,
) -> Timings:
    """Approve a waiting bare workflow, its write's time read by ``recorded``."""
    t0 = time.time()
    await handle.execute_update(bare.DECIDE, "approved", result_type=str)
    returned = time.time()
    await handle.result()
    done = time.time()
    written = recorded(stack.bare_db, handle.id)
    assert written is not None, "the bare write was not recorded"
    return {
        "update": returned - t0,
        "write": written - t0,
        "result": done - t0,
        "pickup": task_waits((await handle.fetch_history()).events, t0),
    }


async def bare_once(
    stack: Stack,
    workflow: str = bare.WORKFLOW,
    recorded: Callable[[str, str], float | None] = bare.written_at,
) -> Timings:
    """One approval of bare Temporal's ``workflow`` (bench/floor.py also
    times ``bare.DURABLE``), its write's time read by ``recorded``."""
    return await bare_decided(stack, await bare_waiting(stack, workflow), recorded)


async def ours_waiting(stack: Stack) -> Waiting:
    """One of our one-write runs started and waiting for approval."""
    store = stack.store
    assert store is not None
    handle = await start_ours(stack, ONE_WRITE)
    approval = await pending_approval(store, handle.id)
    return handle, approval, await store.get_action(approval["action_id"])


async def ours_decided(stack: Stack, waiting: Waiting) -> Timings:
    store = stack.store
    assert store is not None
    handle, approval, action = waiting
    t0 = time.time()
    await approve(stack, approval, action["arguments_digest"])
    returned = time.time()
    await handle.result()
    done = time.time()
    finished = (await store.get_action(action["id"]))["finished_at"]
    return {
        "update": returned - t0,
        "write": finished.timestamp() - t0,
        "result": done - t0,
        "pickup": task_waits((await handle.fetch_history()).events, t0),
    }


def task_waits(events: Sequence[Any], since: float) -> float:
    """Seconds the server held this decision's workflow tasks before a
    worker started them: each task scheduled at or after ``since`` (the
    decision call, by this machine's clock, which the dev server shares),
    from its scheduled event to its started one, summed.

    Part of decide → workflow result that neither side's code spends.
    Under the dev server's transfer-queue cap (lifted since 2026-12-07,
    ``stack.SERVER_ARGS``) the task after the write waited here up to 50 ms
    on whichever side came next; with the cap lifted, 2 to 4 ms
    (bench/README.md, "The dev server's transfer queue")."""
    scheduled: dict[int, float] = {}
    waited = 0.0
    for event in events:
        at = event.event_time.ToDatetime(tzinfo=UTC).timestamp()
        if event.HasField("workflow_task_scheduled_event_attributes") and at >= since:
            scheduled[event.event_id] = at
        elif event.HasField("workflow_task_started_event_attributes"):
            started = event.workflow_task_started_event_attributes
            begun = scheduled.pop(started.scheduled_event_id, None)
            if begun is not None:
                waited += at - begun
    return waited


async def ours_once(stack: Stack) -> Timings:
    return await ours_decided(stack, await ours_waiting(stack))


async def history_events(stack: Stack) -> dict[str, int]:
    """Events one approved write adds to a run: a run with one write,
    decided, against the same run with none."""
    assert stack.store is not None and stack.bare_client is not None
    counts = {}
    for name, script in (("one", ONE_WRITE), ("none", NO_WRITE)):
        handle = await start_ours(stack, script)
        if script is ONE_WRITE:
            await approve(stack, await pending_approval(stack.store, handle.id))
        await handle.result()
        counts[name] = len((await handle.fetch_history()).events)
    key = f"bare-h-{uuid.uuid4().hex[:8]}"
    handle = await stack.bare_client.start_workflow(bare.WORKFLOW, key, id=key, task_queue=BARE)
    await handle.execute_update(bare.DECIDE, "approved", result_type=str)
    await handle.result()
    return {
        "ours_per_approved_write": counts["one"] - counts["none"],
        "ours_run_with_one_write": counts["one"],
        "bare_workflow": len((await handle.fetch_history()).events),
    }


async def start_ours(stack: Stack, script: dict[str, Any]) -> Any:
    assert stack.ours_client is not None
    run_id = f"run-bench-{uuid.uuid4().hex[:12]}"
    # No manager: bare's approval ends with its write, and so does this run
    # (with the manager's summing-up, a model turn after the write, the
    # round trip to the result was twice as long; bench/README.md).
    request = RunInput(
        run_id=run_id,
        task_text="bench",
        seats=["seat-1"],
        max_rounds=1,
        manager=None,
        script=script,
    )
    return await stack.ours_client.start_workflow(
        RUN_WORKFLOW, WorkflowArgs(request=request), id=run_id, task_queue=OURS
    )


async def approve(stack: Stack, approval: dict[str, Any], digest: str | None = None) -> None:
    """As the API decides: through operations.decide, attested as an operator."""
    assert stack.ours_client is not None and stack.store is not None
    await operations.decide(
        stack.ours_client,
        stack.store,
        approval["id"],
        "approved",
        "bench-operator",
        arguments_digest=digest,
        decider=Decider(user_id="bench-operator", role="operator"),
    )


async def _waiting(handle: Any, within: float = 30) -> None:
    """Until the workflow's first task has completed: it is waiting."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        history = await handle.fetch_history()
        if any(e.HasField("workflow_task_completed_event_attributes") for e in history.events):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{handle.id} never started waiting")


async def pending_approval(store: Any, run_id: str, within: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            pending = await store.list_approvals(run_id=run_id, status="pending")
        except Exception:  # the run row may not exist yet
            pending = []
        if pending:
            return pending[0]
        await asyncio.sleep(0.02)
    raise AssertionError(f"{run_id} never asked for approval")


async def measure(
    stack: Stack, approvals: int, warmup: int = 3, profile: Path | None = None
) -> dict[str, Any]:
    """``profile``: sample both workers with py-spy over the measured loop."""
    ours: list[dict[str, float]] = []
    base: list[dict[str, float]] = []
    pids = stack.pids()
    for _ in range(warmup):
        await bare_once(stack)
        await ours_once(stack)
    cpu = {side: cpu_seconds(pid) for side, pid in pids.items()}
    with sampled(pids, profile, "approvals"):
        for start in range(0, approvals, BATCH):  # each worker serves its own side only
            size = min(BATCH, approvals - start)
            bares = await asyncio.gather(*(bare_waiting(stack) for _ in range(size)))
            ourses = await asyncio.gather(*(ours_waiting(stack) for _ in range(size)))
            for waiting_bare, waiting_ours in zip(bares, ourses, strict=True):
                base.append(await bare_decided(stack, waiting_bare))
                ours.append(await ours_decided(stack, waiting_ours))
    spent = {side: cpu_seconds(pid) - cpu[side] for side, pid in pids.items()}
    figures: dict[str, Any] = {"approvals": approvals}
    for key, what in FIGURES:
        b, o = summary([s[key] for s in base]), summary([s[key] for s in ours])
        figures[key] = {
            "what": what,
            "bare": b,
            "ours": o,
            "ratio_p50": round(o["p50_ms"] / b["p50_ms"], 2) if b["p50_ms"] else None,
            "ratio_p95": round(o["p95_ms"] / b["p95_ms"], 2) if b["p95_ms"] else None,
        }
    per_approval = {side: round(1000 * s / approvals, 1) for side, s in spent.items()}
    figures["worker_cpu_per_approval"] = {
        "bare_ms": per_approval["bare"],
        "ours_ms": per_approval["ours"],
        "ratio": round(per_approval["ours"] / per_approval["bare"], 2)
        if per_approval["bare"]
        else None,
    }
    figures["history_events"] = await history_events(stack)
    return figures
