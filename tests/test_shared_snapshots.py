"""A worker's runs share one copy of each capability snapshot
(roundtable/shared_snapshots.py): equal snapshots only, frozen, and a run's
writes go on as before."""

from __future__ import annotations

import gc

import pytest
from pydantic import ValidationError

from roundtable import shared_snapshots
from roundtable.models import (
    CapabilitySnapshot,
    Decision,
    RunInput,
    RunState,
    SeatGrant,
    ToolSpec,
    WorkflowArgs,
)
from roundtable.shared_snapshots import shared_snapshot
from tests.workflow_harness import harness, script, ticket_call
from workflows.roundtable import RoundtableWorkflow


def _snapshot(risk: str = "R2") -> CapabilitySnapshot:
    spec = ToolSpec(
        name="ticket_update",
        description="Set fields on a ticket.",
        side_effect="write",
        risk_level=risk,
        parameters={"type": "object", "properties": {"ticket_id": {"type": "string"}}},
    )
    return CapabilitySnapshot(
        tools=[spec], agents=[SeatGrant(agent_id="seat-1", tools=["ticket_update"])]
    )


@pytest.fixture(autouse=True)
def _empty_table() -> None:
    shared_snapshots._by_digest.clear()


def test_equal_snapshots_become_one_object_and_unequal_ones_stay_apart() -> None:
    first, again = _snapshot(), _snapshot()
    assert first is not again
    assert shared_snapshot("d1", first) is first
    assert shared_snapshot("d1", again) is first
    # The same digest with another value (a digest that lies, or a bug):
    # the run keeps its own, never the other's.
    other = _snapshot("R3")
    assert shared_snapshot("d1", other) is other
    assert shared_snapshot("d1", _snapshot("R3")) is other
    assert shared_snapshot("d1", _snapshot()) is not first  # and is its own again


def test_no_digest_or_no_snapshot_keeps_what_it_was_given() -> None:
    mine = _snapshot()
    assert shared_snapshot(None, mine) is mine
    assert shared_snapshot("d1", None) is None
    assert shared_snapshot(None, _snapshot()) is not mine
    assert shared_snapshots._by_digest == {}


def test_the_table_is_bounded() -> None:
    for n in range(shared_snapshots.KEPT * 3):
        assert shared_snapshot(f"d{n}", _snapshot()).tools[0].name == "ticket_update"
        assert len(shared_snapshots._by_digest) <= shared_snapshots.KEPT


def test_a_snapshot_and_what_it_holds_are_frozen() -> None:
    snapshot = _snapshot()
    with pytest.raises(ValidationError):
        snapshot.tools = []  # type: ignore[misc]
    with pytest.raises(ValidationError):
        snapshot.tools[0].risk_level = "R0"  # type: ignore[misc]
    with pytest.raises(ValidationError):
        snapshot.agents[0].tools = ["ticket_close"]  # type: ignore[misc]


def _cached_runs() -> dict[str, RoundtableWorkflow]:
    """The runs the in-process worker holds now, by run id."""
    return {
        run.state.run_id: run for run in gc.get_objects() if isinstance(run, RoundtableWorkflow)
    }


async def test_two_waiting_runs_hold_one_snapshot_and_both_writes_still_run(tmp_path) -> None:
    one_write = script(("seat-1", 1, [ticket_call("ticket_update")]))
    async with harness(tmp_path) as h:
        handles = [await h.start(task_text=f"t{n}", script=one_write) for n in range(2)]
        approvals = []
        for handle in handles:
            state = await h.wait_for(handle, lambda s: bool(s.pending_approvals))
            approvals += state.pending_approvals
        runs = _cached_runs()
        first, second = (runs[handle.id] for handle in handles)
        assert first.state.snapshot is not None
        assert first.state.snapshot is second.state.snapshot
        assert first.state.snapshot_digest == second.state.snapshot_digest

        for handle, approval_id in zip(handles, approvals, strict=True):
            decision = Decision(approval_id=approval_id, decision="approved", decided_by="op-1")
            assert await handle.execute_update(RoundtableWorkflow.decide_approval, decision)
            assert (await handle.result()).status == "completed"
            (action,) = await h.store.list_actions(handle.id)
            assert action["status"] == "succeeded"
        assert len(await h.tickets.write_log()) == 2


def test_a_run_continued_as_new_takes_the_shared_copy_too() -> None:
    kept = shared_snapshot("d-carried", _snapshot())
    carried = RunState(run_id="r1", snapshot=_snapshot(), snapshot_digest="d-carried")
    request = RunInput(run_id="r1", task_text="t", seats=["seat-1"])
    run = RoundtableWorkflow(WorkflowArgs(request=request, carried=carried))
    assert run.state.snapshot is kept
