"""Runs whose workflow closed under them: nothing is left that nobody can settle.

Once seen on main: terminate or cancel a run while an action is unknown, and
`roundtable reconcile` and the API answered 409 "no live workflow" for ever,
while another run's write to the same ticket waited for ever; a terminated
run stayed `running` in the store, and its event stream never ended.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from temporalio.client import WorkflowHandle

from activities.sweep_activities import SweepActivities, SweepOutput
from roundtable.client import RoundtableClient
from roundtable.store.schema import ApprovalRow
from tests.api_server import Api, serve_api
from tests.conftest import TEST_SECRET
from tests.helpers import set_column
from tests.test_workflow_execution import wrap_tool
from tests.workflow_harness import Harness, harness, script, ticket_call
from workflows.sweep import SweepWorkflow

AUTO = "auto_approve_up_to:R3"
CLI = str(Path(sys.executable).parent / "roundtable")


def acts_then_raises(handler):  # type: ignore[no-untyped-def]
    async def handle(args, ctx):  # type: ignore[no-untyped-def]
        if ctx.fencing_token == 1:  # only the first writer's answer is lost
            await handler(args, ctx)
            raise ConnectionResetError("connection reset after the write")
        return await handler(args, ctx)

    return handle


def update(ticket: str = "T-1", owner: str = "a") -> dict:
    return script(("seat-1", 1, [ticket_call("ticket_update", ticket, fields={"owner": owner})]))


def answer_lost(registry, _tickets) -> None:  # type: ignore[no-untyped-def]
    """The harness's customizer: the first ticket_update's answer is lost."""
    wrap_tool(registry, "ticket_update", acts_then_raises)


async def unknown_update(h: Harness) -> tuple[WorkflowHandle, str]:
    """A run whose update of T-1 is unknown (its answer lost: answer_lost)."""
    handle = await h.start(task_text="t", script=update(), write_policy=AUTO)
    state = await h.wait_for(handle, lambda s: bool(s.unknown_actions))
    (action_id,) = state.unknown_actions
    return handle, action_id


async def unknown_then_closed(h: Harness, how: str) -> tuple[str, str]:
    """A run whose write is unknown, then its workflow closed by ``how``."""
    handle, action_id = await unknown_update(h)
    if how == "terminate":
        await handle.terminate(reason="stuck, said the on-call")
    else:
        await handle.cancel()
        await h.wait_for(handle, lambda s: s.status == "cancelled")
    return handle.id, action_id


def cli_reconcile(h: Harness, tmp_path: Path, action_id: str) -> tuple[int, dict]:
    done = subprocess.run(
        [CLI, "reconcile", action_id, "--outcome", "succeeded", "--note", "seen", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={
            "PATH": str(Path(sys.executable).parent),
            "ROUNDTABLE_DATABASE_URL": f"sqlite+aiosqlite:///{tmp_path / 'roundtable.db'}",
            "ROUNDTABLE_TEMPORAL_ADDRESS": h.client.service_client.config.target_host,
            "ROUNDTABLE_TASK_QUEUE": h.task_queue,
            "ROUNDTABLE_ACTION_SECRET_KEY": TEST_SECRET,
        },
    )
    return done.returncode, json.loads(done.stdout)


async def reconcile_via(via: str, h: Harness, api: Api, tmp_path: Path, run_id: str, action: str):  # type: ignore[no-untyped-def]
    if via == "api":
        answer = await api.http.post(
            f"/v1/actions/{action}/reconcile",
            headers=api.auth("ops"),
            json={"outcome": "succeeded", "note": "the ticket shows the write"},
        )
        assert answer.status_code == 200, answer.text
        return answer.json()["status"]
    if via == "cli":
        code, answer = await asyncio.to_thread(cli_reconcile, h, tmp_path, action)
        assert code == 0, answer
        return answer["status"]
    client = RoundtableClient(h.client, h.task_queue)
    return await client.reconcile(run_id, action, "succeeded", decided_by="svc")


@pytest.mark.parametrize("how", ["terminate", "cancel"])
@pytest.mark.parametrize("via", ["api", "cli", "client"])
async def test_an_unknown_of_a_closed_run_is_reconciled_and_unblocks_its_target(
    tmp_path, how: str, via: str
) -> None:
    # On the dev server, in real time: on the time-skipping test server the
    # waiting run was seen (1 in a few full-suite runs, never alone) to have
    # a workflow task started and never completed, when the reconciliation's
    # signal landed at the virtual instant its 1 s retry timer was due, with
    # every worker idle. Nothing here needs time skipped: the signal wakes
    # the write, and its retry timers start at a second.
    async with (
        harness(
            tmp_path,
            customize=answer_lost,
            dev_server=True,
        ) as h,
        serve_api(h) as api,
    ):
        run_id, action_id = await unknown_then_closed(h, how)
        waiting = await h.start(task_text="t", script=update(owner="b"), write_policy=AUTO)
        await h.wait_for(waiting, lambda s: bool(s.blocked_writes))

        assert await reconcile_via(via, h, api, tmp_path, run_id, action_id) == "succeeded"
        settled = await h.store.get_action(action_id)
        assert settled["status"] == "succeeded" and settled["result"]["reconciled_outcome"]
        assert (await h.result(waiting)).status == "completed"  # the ticket is free again
        log = await h.tickets.write_log()
        assert [w["outcome"] for w in log] == ["applied", "applied"]
        events = [e["event_type"] for e in await h.store.list_events(run_id)]
        assert "action.reconciled" in events


async def test_the_sweep_settles_a_terminated_run_and_its_stream_ends(tmp_path) -> None:
    slow = script(
        ("seat-1", 1, [ticket_call("ticket_update", "T-1")]),
        ("seat-2", 1, [ticket_call("ticket_close", "T-2")]),
    )
    async with harness(tmp_path, write_delay=3.0) as h, serve_api(h) as api:
        handle = await h.start(
            task_text="t",
            script=slow,
            mode="parallel",
            write_policy="auto_approve_up_to:R2",  # the update runs, the close waits
            heartbeat_timeout_seconds=2,
            user_id="alice",
        )
        await h.wait_for(handle, lambda s: bool(s.pending_approvals))
        for _ in range(200):
            if await h.tickets.write_log():
                break
            await asyncio.sleep(0.05)
        await handle.terminate(reason="stuck, said the on-call")
        assert (await h.store.get_run(handle.id))["status"] == "waiting_input"  # not yet told

        stream = asyncio.create_task(follow_events(api, handle.id))
        settled, stalled = await SweepActivities(h.store, h.client).check_runs()
        assert (settled, stalled) == ([handle.id], [])
        run = await h.store.get_run(handle.id)
        assert run["status"] == "terminated"
        assert run["failure"] == {
            "code": "workflow_terminated",
            "message": "terminated: stuck, said the on-call",
        }
        by_tool = {a["tool_name"]: a for a in await h.store.list_actions(handle.id)}
        assert by_tool["ticket_update"]["status"] == "unknown"
        assert by_tool["ticket_update"]["result"]["error_code"] == (
            "workflow_closed_during_execution"
        )
        assert by_tool["ticket_close"]["status"] == "rejected"
        (approval,) = await h.store.list_approvals(run_id=handle.id)
        assert approval["status"] == "withdrawn"
        shown = (await api.http.get(f"/v1/runs/{handle.id}", headers=api.auth("alice"))).json()
        assert shown["status"] == "terminated" and shown["failure"]["code"] == "workflow_terminated"
        events = await asyncio.wait_for(stream, 10)  # the stream ends with the run
        assert "run.status_changed" in [e["event_type"] for e in events]
        assert await SweepActivities(h.store, h.client).check_runs() == ([], [])  # idempotent


async def follow_events(api: Api, run_id: str) -> list[dict]:
    received = []
    headers = {**api.auth("alice"), "Accept": "text/event-stream"}
    async with api.http.stream("GET", f"/v1/runs/{run_id}/events", headers=headers) as stream:
        async for line in stream.aiter_lines():
            if line.startswith("data: "):
                received.append(json.loads(line[6:]))
    return received


async def test_a_run_that_fails_says_why(tmp_path) -> None:
    # Any model gets past the API here, so the worker is the one to fail it.
    async with harness(tmp_path) as h, serve_api(h, allowed_models=["*"]) as api:
        response = await api.http.post(
            "/v1/runs",
            headers=api.auth("alice"),
            json={"task_text": "t", "model": "no-such-vendor:model"},
        )
        run_id = response.json()["run_id"]
        for _ in range(200):
            shown = (await api.http.get(f"/v1/runs/{run_id}", headers=api.auth("alice"))).json()
            if shown["status"] == "failed":
                break
            await asyncio.sleep(0.05)
        assert shown["status"] == "failed"
        assert shown["failure"]["code"] == "InvalidInput"
        assert "no-such-vendor" in shown["failure"]["message"]


async def test_a_run_whose_nudge_was_lost_is_nudged_by_the_sweep(tmp_path) -> None:
    """Found in review: reconciled in the store, the refresh signal lost (a
    Temporal blip, a crashed API): the run waited for ever, and asking again
    was refused because the action was no longer unknown."""
    async with harness(tmp_path, customize=answer_lost) as h:
        handle, action_id = await unknown_update(h)
        await h.store.reconcile_action(action_id, "succeeded", "op-1", "seen")  # no nudge
        await asyncio.sleep(0.5)
        assert (await h.state(handle)).unknown_actions  # still waiting
        await SweepActivities(h.store, h.client).check_runs()
        assert (await handle.result()).status == "completed"


async def test_the_sweep_workflow_expires_what_is_due_and_nudges_the_runs_still_open(
    tmp_path,
) -> None:
    """The schedule's workflow itself, end to end: two runs' approvals are due
    by the database's clock while their workflows' timers have an hour to go;
    one run's workflow is gone. The sweep expires both in the store, the live
    run hears of it and ends without the write, and the gone one is passed
    over rather than failing the sweep."""
    async with harness(tmp_path) as h:
        handles = [await h.start(task_text="t", script=update(ticket)) for ticket in ("T-1", "T-2")]
        approvals = []
        for handle in handles:
            state = await h.wait_for(handle, lambda s: bool(s.pending_approvals))
            approvals.extend(state.pending_approvals)
            await set_column(
                h.store,
                ApprovalRow,
                ApprovalRow.id == approvals[-1],
                expires_at=datetime.now(UTC) - timedelta(seconds=1),
            )
        live, gone = handles
        await gone.terminate(reason="gone before the sweep")

        # Real time only: skipped time would fire the live run's own timer.
        with h.env.auto_time_skipping_disabled():
            sweep = h.client.execute_workflow(
                SweepWorkflow.run, id="sweep-now", task_queue=h.task_queue, result_type=SweepOutput
            )
            swept = await asyncio.wait_for(sweep, 30)
            assert sorted(swept.expired_approvals) == sorted(approvals)
            assert sorted(swept.run_ids) == sorted(handle.id for handle in handles)
            assert swept.settled_runs == [gone.id]
            assert (await asyncio.wait_for(live.result(), 30)).status == "completed"
        for approval_id in approvals:
            assert (await h.store.get_approval(approval_id))["status"] == "expired"
        assert await h.tickets.write_log() == []
