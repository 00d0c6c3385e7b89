"""End to end on the real Temporal dev server, through the CLI, with the worker
as its own process: what an operator actually types."""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from roundtable.names import SWEEP_SCHEDULE_ID
from tests.e2e_stack import Stack, one_write_script, running_stack


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[Stack]:
    async with running_stack(tmp_path) as made:
        yield made


async def test_operator_flow_through_the_cli(stack: Stack) -> None:
    run_script = one_write_script(stack.workdir / "script.json", "T-1")
    started = await stack.start("--task", "raise T-1", "--script", run_script, "--user", "alice")
    run_id = started["run_id"]
    assert started["workflow_id"] == run_id

    pending = await stack.pending_approvals(run_id, "a pending approval")
    (approval,) = pending
    assert approval["tool_name"] == "ticket_update" and approval["agent_id"] == "seat-1"
    assert approval["arguments"]["ticket_id"] == "T-1"

    code, shown = await asyncio.to_thread(stack.cli, "show", run_id)
    assert code == 0 and shown["status"] == "waiting_input"
    assert shown["actions"][0]["status"] == "waiting_approval"
    assert "target_key" not in shown["actions"][0]

    code, done = await asyncio.to_thread(stack.cli, "approve", approval["id"], "--by", "op-7")
    assert (code, done["status"]) == (0, "approved")
    code, again = await asyncio.to_thread(stack.cli, "approve", approval["id"])
    assert code == 3 and again["error"]["code"] == "conflict"
    code, missing = await asyncio.to_thread(stack.cli, "approve", "no-such-approval")
    assert code == 4 and missing["error"]["code"] == "not_found"

    final = await asyncio.to_thread(
        stack.until,
        stack.run_with_status(run_id, "completed"),
        "the run to complete",
    )
    assert final["actions"][0]["status"] == "succeeded"
    assert final["approvals"][0]["decided_by"] == "op-7"
    assert final["final_answer"] == "all done"
    code, log = await asyncio.to_thread(stack.cli, "tickets")
    assert code == 0 and [(w["ticket_id"], w["outcome"]) for w in log] == [("T-1", "applied")]

    # The worker put the sweep on a schedule.
    description = await stack.env.client.get_schedule_handle(SWEEP_SCHEDULE_ID).describe()
    assert description.id == SWEEP_SCHEDULE_ID


async def test_unknown_outcome_is_reconciled_through_the_cli(stack: Stack) -> None:
    run_script = one_write_script(stack.workdir / "chaos.json", "T-13")
    started = await stack.start(
        "--task", "t", "--script", run_script, "--policy", "auto_approve_up_to:R3"
    )
    run_id = started["run_id"]
    view = await asyncio.to_thread(
        stack.until,
        stack.run_with_status(run_id, "waiting_input"),
        "the run to wait for an operator",
    )
    (action,) = view["actions"]
    assert action["status"] == "unknown"

    code, refused = await asyncio.to_thread(
        stack.cli, "reconcile", action["id"], "--outcome", "maybe", "--note", "x"
    )
    assert code == 2 and "--outcome" in refused["error"]["message"]
    code, settled = await asyncio.to_thread(
        stack.cli,
        "reconcile",
        action["id"],
        "--outcome",
        "succeeded",
        "--note",
        "the ticket shows the change",
    )
    assert (code, settled["status"]) == (0, "succeeded")
    await asyncio.to_thread(
        stack.until,
        lambda: stack.cli("show", run_id)[1]["status"] == "completed",
        "completion after reconciliation",
    )
    code, log = await asyncio.to_thread(stack.cli, "tickets")
    assert [w["ticket_id"] for w in log] == ["T-13"]  # written once, never replayed


async def test_cli_errors_are_clear(stack: Stack) -> None:
    code, bad = await asyncio.to_thread(stack.cli, "start", "--task", "t", "--policy", "yolo")
    assert code == 2 and "write_policy" in bad["error"]["message"]
    missing = stack.workdir / "nope.json"
    code, bad = await asyncio.to_thread(stack.cli, "start", "--task", "t", "--script", str(missing))
    assert code == 2 and "cannot read script" in bad["error"]["message"]
    code, down = await asyncio.to_thread(
        stack.cli, "start", "--task", "t", env={"ROUNDTABLE_TEMPORAL_ADDRESS": "127.0.0.1:1"}
    )
    assert code == 1 and "cannot reach Temporal" in down["error"]["message"]
    code, gone = await asyncio.to_thread(stack.cli, "show", "no-such-run")
    assert code == 4 and gone["error"]["code"] == "not_found"


async def test_a_plain_temporal_signal_is_attributed_to_its_sender(stack: Stack) -> None:
    """`temporal workflow signal` users: decided_by is the sender's Temporal
    identity, whatever name the body claims."""
    from tests.temporal_servers import venv_binary

    started = await stack.start(
        "--task", "t", "--script", one_write_script(stack.workdir / "s.json", "T-5")
    )
    run_id = started["run_id"]
    (approval,) = await stack.pending_approvals(run_id, "an approval")
    body = json.dumps(
        {"approval_id": approval["id"], "decision": "approved", "decided_by": "mallory"}
    )
    done = await asyncio.to_thread(
        subprocess.run,
        [
            venv_binary("temporal"),
            "workflow",
            "signal",
            "--address",
            stack.address,
            "-w",
            run_id,
            "--name",
            "approval_decision",
            "--input",
            body,
            "--identity",
            "ops-alice",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    final = await asyncio.to_thread(
        stack.until, stack.run_with_status(run_id, "completed"), "completion"
    )
    assert final["approvals"][0]["decided_by"] == "temporal:ops-alice"
