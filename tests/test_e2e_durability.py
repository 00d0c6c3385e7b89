"""Durability on the real dev server: worker crashes, the sweep, continue-as-new."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from pathlib import Path

from roundtable.config import Settings
from roundtable.models import RunState
from roundtable.names import SWEEP_SCHEDULE_ID
from roundtable.security import derive_target
from roundtable.store import open_store
from roundtable.store.schema import ApprovalRow
from tests.e2e_stack import Stack, one_write_script, running_stack
from tests.helpers import set_column
from worker import ensure_sweep_schedule
from workflows.roundtable import RoundtableWorkflow


async def test_a_restarted_worker_resumes_waiting_runs(tmp_path: Path) -> None:
    async with running_stack(tmp_path) as stack:
        started = await stack.start(
            "--task", "t", "--script", one_write_script(tmp_path / "s.json")
        )
        run_id = started["run_id"]
        (approval,) = await stack.pending_approvals(run_id, "an approval")
        stack.kill_worker(stack.workers[0])
        stack.start_worker()
        code, _ = await asyncio.to_thread(stack.cli, "approve", approval["id"])
        assert code == 0
        await asyncio.to_thread(
            stack.until, stack.run_with_status(run_id, "completed"), "completion"
        )
        _, log = await asyncio.to_thread(stack.cli, "tickets")
        assert [w["outcome"] for w in log] == ["applied"]


async def start_auto_write(stack: Stack, workdir: Path, heartbeat: int, lease: int) -> dict:
    """A run whose one write needs nobody's approval, with these timings."""
    return await stack.start(
        "--task",
        "t",
        "--script",
        one_write_script(workdir / "s.json"),
        "--policy",
        "auto_approve_up_to:R3",
        "--heartbeat-timeout",
        str(heartbeat),
        "--lease-seconds",
        str(lease),
    )


async def test_worker_killed_mid_write_leaves_unknown_and_never_replays(tmp_path: Path) -> None:
    async with running_stack(tmp_path, demo_ticket_write_delay_seconds="30") as stack:
        # A lease long enough that a loaded machine still asks before it runs out.
        started = await start_auto_write(stack, tmp_path, heartbeat=3, lease=40)
        run_id = started["run_id"]
        await asyncio.to_thread(stack.until, lambda: stack.cli("tickets")[1], "the write to start")
        stack.kill_worker(stack.workers[0])  # mid-write: the ticket is half done
        stack.start_worker()

        view = await asyncio.to_thread(
            stack.until, stack.run_with_status(run_id, "waiting_input"), "unknown", within=90
        )
        (action,) = view["actions"]
        assert action["status"] == "unknown"
        assert action["attempt_count"] == 1
        _, log = await asyncio.to_thread(stack.cli, "tickets")
        assert [w["outcome"] for w in log] == ["started"]  # in doubt, as the outside saw it

        reconcile = (
            "reconcile",
            action["id"],
            "--outcome",
            "failed",
            "--note",
            "ticket shows no change",
        )
        # The dead worker cannot say its attempt ended: its lease must run out first.
        code, refused = await asyncio.to_thread(stack.cli, *reconcile)
        assert code == 3 and refused["error"]["code"] == "attempt_may_be_running"
        await asyncio.to_thread(
            stack.until, lambda: stack.cli(*reconcile)[0] == 0, "the lease to run out", 90
        )
        await asyncio.to_thread(
            stack.until, stack.run_with_status(run_id, "completed"), "completion"
        )
        _, log = await asyncio.to_thread(stack.cli, "tickets")
        assert len(log) == 1  # no second attempt, ever


async def test_sweep_schedule_expires_approvals_of_runs_without_a_workflow(
    tmp_path: Path,
) -> None:
    async with running_stack(tmp_path) as stack:
        schedule = stack.env.client.get_schedule_handle(SWEEP_SCHEDULE_ID)

        async def schedule_exists() -> bool:
            try:
                await schedule.describe()
                return True
            except Exception:
                return False

        for _ in range(100):
            if await schedule_exists():
                break
            await asyncio.sleep(0.2)
        settings = Settings(
            database_url=stack.vars["ROUNDTABLE_DATABASE_URL"],
            task_queue=stack.vars["ROUNDTABLE_TASK_QUEUE"],
        )
        assert await ensure_sweep_schedule(stack.env.client, settings) == "unchanged"

        async with open_store(settings.database_url) as store:
            session = await store.create_session(user_id="u", task_text="orphaned run")
            run = await store.create_run(session_id=session["id"], user_id="u")
            snapshot = {
                "tools": [{"name": "ticket_update", "target_key_fields": ["ticket_id"]}],
                "agents": [{"agent_id": "seat-1", "tools": ["ticket_update"]}],
            }
            target = derive_target("ticket_update", {"ticket_id": "T-5"}, snapshot, "seat-1")
            action = await store.create_action(
                {
                    "session_id": session["id"],
                    "run_id": run["id"],
                    "agent_id": "seat-1",
                    "tool_name": "ticket_update",
                    "idempotency_key": "orphan-1",
                    "target_key": target.key,
                    "risk_level": "R2",
                    "status": "waiting_approval",
                    "approval_expires_at": datetime.now(UTC) + timedelta(minutes=5),
                }
            )
            await set_column(
                store,
                ApprovalRow,
                ApprovalRow.id == action["approval_id"],
                expires_at=datetime.now(UTC) - timedelta(seconds=1),
            )

            await schedule.trigger()
            for _ in range(150):
                if (await store.get_approval(action["approval_id"]))["status"] == "expired":
                    break
                await asyncio.sleep(0.2)
            assert (await store.get_approval(action["approval_id"]))["status"] == "expired"
            assert (await store.get_action(action["id"]))["status"] == "rejected"


async def test_long_runs_continue_as_new_and_keep_their_state(tmp_path: Path) -> None:
    suggest_early = ["--dynamic-config-value", "limit.historyCount.suggestContinueAsNew=30"]
    async with running_stack(tmp_path, suggest_early) as stack:
        started = await stack.start(
            "--task", "a long discussion", "--rounds", "6", "--seats", "seat-1,seat-2,seat-3"
        )
        run_id = started["run_id"]
        await asyncio.to_thread(
            stack.until, stack.run_with_status(run_id, "completed"), "completion"
        )

        handle = stack.env.client.get_workflow_handle(run_id)
        state = await handle.query(RoundtableWorkflow.state, result_type=RunState)
        assert state.round == 6 and len(state.transcript) == 18  # carried across runs
        first_run = stack.env.client.get_workflow_handle(run_id, first_execution_run_id=None)
        history = [e async for e in first_run.fetch_history_events()]
        assert history  # the latest run's history
        described = await handle.describe()
        assert described.run_id != (await _first_run_id(stack, run_id))


async def _first_run_id(stack: Stack, workflow_id: str) -> str:
    runs = [w async for w in stack.env.client.list_workflows(f"WorkflowId = '{workflow_id}'")]
    return min(runs, key=lambda w: w.start_time).run_id


async def test_a_crash_is_unknown_within_the_heartbeat_timeout_and_two_seconds(
    tmp_path: Path,
) -> None:
    """Once the next workflow task waited out the dead worker's sticky queue
    (10 s by default) before another worker could take it."""
    heartbeat = 3
    async with running_stack(tmp_path, demo_ticket_write_delay_seconds="60") as stack:
        started = await start_auto_write(stack, tmp_path, heartbeat=heartbeat, lease=30)
        await asyncio.to_thread(stack.until, lambda: stack.cli("tickets")[1], "the write")
        stack.start_worker()  # warm before the crash: we time detection, not start-up
        log = tmp_path / "worker.log"
        await asyncio.to_thread(
            stack.until, lambda: log.read_text().count("worker polling") >= 2, "a second worker"
        )
        async with open_store(stack.vars["ROUNDTABLE_DATABASE_URL"]) as store:
            (action,) = await store.list_actions(started["run_id"])
            crashed = asyncio.get_running_loop().time()
            stack.kill_worker(stack.workers[0])
            while (await store.get_action(action["id"]))["status"] != "unknown":
                assert asyncio.get_running_loop().time() - crashed < 60, "never became unknown"
                await asyncio.sleep(0.05)
            took = asyncio.get_running_loop().time() - crashed
        assert took <= heartbeat + 2, f"crash → unknown took {took:.1f} s"
