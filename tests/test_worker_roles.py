"""Worker roles (issue 14): a workflows worker that holds no tools, tool
workers that serve them on their own task queue, runs routed between the two
through the catalog the tool workers publish. Real time-skipping server, real
workers, real SQLite store and demo ticket system."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowHandle, WorkflowUpdateFailedError
from temporalio.worker import Worker

from roundtable import operations
from roundtable.config import Settings
from roundtable.names import NO_TOOL_WORKER, REFRESH_SIGNAL
from roundtable.store import ConflictError
from roundtable.tools.registry import ToolRegistry
from tests.test_edits import decide
from tests.test_workflow_execution import operator_says, reconcile, wrap_tool
from tests.workflow_harness import TRUSTING, Harness, harness, script, ticket_call
from worker import build_worker, own_queue, tool_queues

ROOT = Path(__file__).resolve().parent.parent
TOOLS_QUEUE = "rt-test-tools"
AUTO = "auto_approve_up_to:R3"
AUTO_R1 = "auto_approve_up_to:R1"  # comments run at once; updates wait for a person
# A call nobody takes is known as such after this long (the time-skipping
# server does not skip time while an activity waits for a worker).
WAIT = {"tool_worker_wait_seconds": 2}


def lost_before_acting(handler):  # type: ignore[no-untyped-def]
    """The first writer's call is lost before it reached the ticket system:
    unknown to Roundtable, and truly failed (what a fence then confirms)."""

    async def handle(args, ctx):  # type: ignore[no-untyped-def]
        if ctx.fencing_token == 1:
            raise ConnectionResetError("connection reset before the write")
        return await handler(args, ctx)

    return handle


async def unknown_write(h: Harness) -> tuple[WorkflowHandle, str]:
    """A run whose write to T-1 is unknown (its call lost before it acted)."""
    run = script(("seat-1", 1, [ticket_call("ticket_update", "T-1")]))
    handle = await h.start(task_text="t", script=run, write_policy=AUTO)
    state = await h.wait_for(handle, lambda s: bool(s.unknown_actions))
    (action_id,) = state.unknown_actions
    return handle, action_id


async def unknown_routed_write(h: Harness) -> tuple[WorkflowHandle, str]:
    """A run whose write to T-1, taken by a tool worker on TOOLS_QUEUE (its
    call lost before it acted), is unknown; that tool worker gone since."""
    wrap_tool(h.registry, "ticket_update", lost_before_acting)
    await publish(h)
    async with tool_worker(h):
        run = script(("seat-1", 1, [ticket_call("ticket_update", "T-1")]))
        handle = await h.start(task_text="t", script=run, write_policy=AUTO, **WAIT)
        state = await h.wait_for(handle, lambda s: bool(s.unknown_actions))
        (action_id,) = state.unknown_actions
    return handle, action_id


def workflows_only(client: Client, queue: str, store, _registry, **options: Any) -> Worker:  # type: ignore[no-untyped-def]
    """The harness's worker as a workflows worker: no tools at all."""
    return build_worker(client, queue, store, ToolRegistry(), role="workflows", **options)


def tool_worker(h: Harness, queue: str = TOOLS_QUEUE, store: Any = None, **options: Any) -> Worker:
    """A tool worker on ``queue``, over ``store`` (the harness's by default)."""
    return build_worker(
        h.client, queue, store or h.store, h.registry, authority=TRUSTING, role="tools", **options
    )


async def publish(h: Harness, queue: str = TOOLS_QUEUE) -> None:
    specs = [tool.spec().model_dump(mode="json") for tool in h.registry.tools.values()]
    await h.store.publish_tools(specs, queue, "test-tool-worker")


async def where_scheduled(handle: WorkflowHandle) -> dict[str, set[str]]:
    """Activity type → the task queues it was scheduled on (remote ones)."""
    seen: dict[str, set[str]] = {}
    async for event in handle.fetch_history_events():
        if event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            attrs = event.activity_task_scheduled_event_attributes
            seen.setdefault(attrs.activity_type.name, set()).add(attrs.task_queue.name)
    return seen


async def test_a_split_run_reads_writes_and_is_decided_on_the_tool_worker(tmp_path) -> None:
    calls = [
        ticket_call("ticket_get", "T-1"),
        ticket_call("ticket_comment", "T-1"),
        ticket_call("ticket_update", "T-2", fields={"owner": "b"}),
    ]
    async with harness(tmp_path, worker_factory=workflows_only) as h:
        await publish(h)
        async with tool_worker(h):
            handle = await h.start(
                task_text="t", script=script(("seat-1", 1, calls)), write_policy=AUTO_R1
            )
            state = await h.wait_for(handle, lambda s: bool(s.pending_approvals))
            assert set(state.tool_queues.values()) == {TOOLS_QUEUE}
            (approval_id,) = state.pending_approvals
            await decide(handle, approval_id)
            assert (await handle.result()).status == "completed"
            scheduled = await where_scheduled(handle)
    # Everything that needs a tool ran on the tool worker, the rest here.
    for needs_a_tool in ("run_read_tool", "intercept_write", "execute_write", "decide_approval"):
        assert scheduled[needs_a_tool] == {TOOLS_QUEUE}, (needs_a_tool, scheduled)
    assert scheduled["take_turn"] == {h.task_queue}
    # Opening the run is a local activity of the workflows worker (a run
    # started before rules-as-of-2026-12 scheduled it on this queue).
    assert "ensure_run" not in scheduled
    log = await h.tickets.write_log()
    assert sorted((w["ticket_id"], w["operation"], w["outcome"]) for w in log) == [
        ("T-1", "comment", "applied"),
        ("T-2", "update", "applied"),
    ]
    actions = await h.store.list_actions(handle.id)
    assert sorted(a["status"] for a in actions) == ["succeeded", "succeeded"]


async def test_a_tool_nobody_serves_waits_saying_so_then_runs_once_served(tmp_path) -> None:
    calls = [ticket_call("ticket_comment", "T-1")]
    async with harness(tmp_path, worker_factory=workflows_only) as h:
        await publish(h, "rt-test-nobody")  # a tool worker that is gone
        handle = await h.start(
            task_text="t", script=script(("seat-1", 1, calls)), write_policy=AUTO, **WAIT
        )
        state = await h.wait_for(handle, lambda s: bool(s.unserved_calls))
        (why,) = state.unserved_calls.values()
        assert "ticket_comment waits: no tool worker serves it" in why and "rt-test-nobody" in why
        assert state.status == "waiting_input"
        assert await h.store.list_actions(handle.id) == []  # nothing was even recorded
        async with tool_worker(h, "rt-test-nobody"):
            assert (await handle.result()).status == "completed"
        done = await h.state(handle)
        assert done.unserved_calls == {}
    log = await h.tickets.write_log()
    assert [(w["ticket_id"], w["operation"], w["outcome"]) for w in log] == [
        ("T-1", "comment", "applied")
    ]


async def test_a_write_whose_worker_went_away_waits_and_runs_once(tmp_path) -> None:
    """The intercept ran on a tool worker that then stopped; the approved
    write waits (never started, so never guessed) and runs once when a tool
    worker is back."""
    calls = [ticket_call("ticket_update", "T-1", fields={"owner": "a"})]
    async with harness(tmp_path, worker_factory=workflows_only) as h:
        await publish(h)
        handle = await h.start(
            task_text="t", script=script(("seat-1", 1, calls)), write_policy=AUTO_R1, **WAIT
        )
        async with tool_worker(h):
            state = await h.wait_for(handle, lambda s: bool(s.pending_approvals))
        (approval_id,) = state.pending_approvals
        # No tool worker: the decision is refused plainly and changes nothing.
        with pytest.raises(WorkflowUpdateFailedError) as refused:
            with h.env.auto_time_skipping_disabled():
                await asyncio.wait_for(decide(handle, approval_id), timeout=60)
        assert "ticket_update waits: no tool worker serves it" in str(refused.value.cause)
        assert refused.value.cause.type == NO_TOOL_WORKER
        (action,) = await h.store.list_actions(handle.id)
        assert action["status"] == "waiting_approval"
        # Decided in the store (as the sweep or another path may), the run told
        # to look: it goes on to the write, with no tool worker to take it.
        await h.store.decide_approval(approval_id, "approved", "op-1")
        await handle.signal(REFRESH_SIGNAL)
        state = await h.wait_for(handle, lambda s: bool(s.unserved_calls))
        assert "no tool worker serves it" in state.unserved_calls[action["id"]]
        (action,) = await h.store.list_actions(handle.id)
        assert action["status"] == "approved" and action["attempt_count"] == 0
        async with tool_worker(h):
            assert (await handle.result()).status == "completed"
    log = await h.tickets.write_log()
    assert [(w["ticket_id"], w["outcome"], w["fencing_token"]) for w in log] == [
        ("T-1", "applied", 1)
    ]


async def test_an_unknown_write_is_reconciled_and_fenced_on_the_tool_worker(tmp_path) -> None:
    async with harness(tmp_path, worker_factory=workflows_only) as h:
        wrap_tool(h.registry, "ticket_update", lost_before_acting)
        await publish(h)
        async with tool_worker(h):
            handle, action_id = await unknown_write(h)
            assert await reconcile(handle, action_id, "failed") == "failed"
            await handle.result()
            scheduled = await where_scheduled(handle)
    assert scheduled["reconcile_action"] == {TOOLS_QUEUE}
    # The tool was fenced (on the tool worker) before "failed" was written.
    action = await h.store.get_action(action_id)
    assert action["status"] == "failed" and action["result"]["fenced_below"] == 2


async def test_a_closed_runs_unknown_is_reconciled_through_the_tool_worker(tmp_path) -> None:
    """A run whose workflow is gone: the reconciliation workflow runs the
    fencing step on a tool worker, found in the catalog. Without the catalog
    a workflows worker refuses rather than skip the fence."""
    async with harness(tmp_path, worker_factory=workflows_only) as h:
        wrap_tool(h.registry, "ticket_update", lost_before_acting)
        await publish(h)
        async with tool_worker(h):
            handle, action_id = await unknown_write(h)
            await handle.terminate(reason="gone")
            with h.env.auto_time_skipping_disabled():
                with pytest.raises(ConflictError, match="runs on tool workers"):
                    await operations.reconcile_request(
                        h.client, handle.id, operator_says(action_id, "failed"), h.task_queue
                    )
                done = await operations.reconcile(
                    h.client, h.store, action_id, "failed", "op-1", "checked", h.task_queue
                )
    assert done["status"] == "failed" and done["via"] == "store"
    assert (await h.store.get_action(action_id))["result"]["fenced_below"] == 2


def test_a_tool_worker_limited_to_some_tools_has_a_queue_for_each() -> None:
    registry = ToolRegistry()
    registry.tools = {"ticket_get": None, "ticket_update": None}  # type: ignore[dict-item]
    everything = Settings(tool_task_queue="tq")
    assert tool_queues(everything, registry) == {"tq": ["ticket_get", "ticket_update"]}
    limited = Settings(tool_task_queue="tq", worker_tools="ticket_update")
    assert tool_queues(limited, registry) == {
        own_queue(limited, "ticket_update"): ["ticket_update"]
    }
    with pytest.raises(ValueError, match="does not have: nope"):
        tool_queues(Settings(worker_tools="nope,ticket_get"), registry)
    assert Settings(task_queue="main").tool_queue() == "main"  # one worker does all


def test_a_workflows_worker_never_imports_tool_code(tmp_path) -> None:
    program = f"""
import asyncio, sys
import worker
from roundtable.config import Settings
from roundtable.names import NO_TOOL_WORKER, REFRESH_SIGNAL

async def main():
    settings = Settings(
        worker_role="workflows", database_url="sqlite+aiosqlite:///{tmp_path}/w.db"
    )
    async with worker.worker_parts(settings) as parts:
        assert not parts.registry.tools and parts.tickets is None

asyncio.run(main())
print(sorted(m for m in sys.modules if m.startswith(("roundtable.tools", "mcp"))))
"""
    done = subprocess.run(
        [sys.executable, "-c", program], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = done.stdout.strip().splitlines()[-1]
    assert loaded == "['roundtable.tools', 'roundtable.tools.policy', 'roundtable.tools.registry']"


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--role", "bogus"], "role: all, workflows or tools"),
        (["--tools", "ticket_get"], "--tools is for a tool worker"),
    ],
)
def test_the_worker_command_refuses_a_bad_role_plainly(args: list[str], said: str) -> None:
    cli = str(Path(sys.executable).parent / "roundtable")
    done = subprocess.run(
        [cli, "worker", *args], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode != 0
    assert said in done.stdout + done.stderr, done.stdout + done.stderr
