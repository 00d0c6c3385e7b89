"""Crash → ``unknown``: how long after a worker dies mid-write the store
records the write as ``unknown`` (target: the run's heartbeat timeout plus
two seconds).

A run's one write (``ticket_comment``, approved by its write policy) takes a
few seconds at the ticket system; once the store says it is executing and
the call is under way, the worker is killed (SIGKILL: no shutdown, no last
heartbeat) and a fresh one started. Timed from the kill to the action's
``unknown`` in the store.
"""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid
from typing import Any

from bench.stack import OURS, Stack
from bench.throughput import POLICY, WORKER_ENV
from roundtable.models import RunInput, WorkflowArgs
from roundtable.names import RUN_WORKFLOW

HEARTBEAT_SECONDS = 4
WRITE_SECONDS = 30  # far longer than the wait: the kill always lands mid-call
SLOW = {**WORKER_ENV, "ROUNDTABLE_DEMO_TICKET_WRITE_DELAY_SECONDS": str(WRITE_SECONDS)}


async def _executing_action(stack: Stack, run_id: str, within: float = 60) -> dict[str, Any]:
    assert stack.store is not None
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            actions = await stack.store.list_actions(run_id)
        except Exception:  # the run row may not exist yet
            actions = []
        if actions and actions[0]["status"] == "executing":
            return actions[0]
        await asyncio.sleep(0.05)
    raise AssertionError(f"{run_id}: its write never started executing")


async def _until_unknown(stack: Stack, action_id: str, within: float = 120) -> float:
    assert stack.store is not None
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if (await stack.store.get_action(action_id))["status"] == "unknown":
            return time.monotonic()
        await asyncio.sleep(0.05)
    raise AssertionError(f"{action_id} never became unknown")


async def once(stack: Stack) -> float:
    key = f"crash-{uuid.uuid4().hex[:12]}"
    comment = {"tenant_id": "acme", "ticket_id": key, "body": "on it"}
    script = {
        "turns": [
            {
                "seat": "seat-1",
                "round": 1,
                "text": "commenting",
                "tool_calls": [{"name": "ticket_comment", "args": comment}],
            }
        ],
        "final": "done",
    }
    request = RunInput(
        run_id=key,
        task_text="bench",
        seats=["seat-1"],
        write_policy=POLICY,
        script=script,
        heartbeat_timeout_seconds=HEARTBEAT_SECONDS,
        lease_seconds=HEARTBEAT_SECONDS * 3,
    )
    assert stack.ours_client is not None
    await stack.ours_client.start_workflow(
        RUN_WORKFLOW, WorkflowArgs(request=request), id=key, task_queue=OURS
    )
    action = await _executing_action(stack, key)
    await asyncio.sleep(0.5)  # the tool call is under way
    stack.kill_ours()
    killed = time.monotonic()
    stack.start_ours(SLOW)
    return await _until_unknown(stack, action["id"]) - killed


async def measure(stack: Stack, crashes: int = 3) -> dict[str, Any]:
    stack.restart_ours(SLOW)
    try:
        taken = [await once(stack) for _ in range(crashes)]
    finally:
        stack.restart_ours()
    return {
        "crashes": crashes,
        "heartbeat_timeout_s": HEARTBEAT_SECONDS,
        "unknown_after_s_median": round(statistics.median(taken), 2),
        "unknown_after_s_max": round(max(taken), 2),
        "target_s": HEARTBEAT_SECONDS + 2,
    }
