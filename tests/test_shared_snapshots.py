"""A worker's runs share one copy of each capability snapshot
(roundtable/shared_snapshots.py): equal snapshots only, frozen, and a run's
writes go on as before."""

from __future__ import annotations

import gc
import re

import pytest
from pydantic import ValidationError

from activities.kept_snapshots import snapshot_digest
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
from roundtable.shared_snapshots import shared_snapshot, value_text
from tests.workflow_harness import harness, script, ticket_call
from workflows.roundtable import RoundtableWorkflow


def _snapshot(risk: str = "R2", bound: float = 10) -> CapabilitySnapshot:
    spec = ToolSpec(
        name="ticket_update",
        description="Set fields on a ticket.",
        side_effect="write",
        risk_level=risk,
        parameters={"type": "object", "properties": {"n": {"maximum": bound}}},
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
    assert shared_snapshot(first) is first
    assert shared_snapshot(again) is first
    other = _snapshot("R3")
    assert shared_snapshot(other) is other
    assert shared_snapshot(_snapshot("R3")) is other
    assert shared_snapshot(_snapshot()) is first
    assert shared_snapshot(None) is None


@pytest.mark.parametrize(("given", "planted"), [(10, 10.0), (0.0, -0.0), (1, True)])
def test_values_python_calls_equal_but_json_does_not_stay_apart(given, planted) -> None:
    """Found by review: keyed by the digest a run claims and compared with
    ``==``, a run started with a made-up state holding ``10.0`` where the
    pinned snapshot says ``10`` planted its copy, every honest run then took
    it, and the store refused their writes (the digests differ)."""
    forged, honest = _snapshot(bound=planted), _snapshot(bound=given)
    assert forged == honest  # what fooled the first version
    assert snapshot_digest(forged) != snapshot_digest(honest)
    assert shared_snapshot(forged) is forged
    taken = shared_snapshot(honest)
    assert taken is honest
    assert snapshot_digest(taken) == snapshot_digest(honest)


def test_every_kept_copy_is_the_one_value_it_is_kept_for() -> None:
    held = [_snapshot(), _snapshot("R3"), _snapshot(bound=10.0), _snapshot()]
    taken = [shared_snapshot(snapshot) for snapshot in held]
    assert taken[3] is taken[0]
    assert len({id(copy) for copy in taken}) == 3
    assert len(shared_snapshots._by_digest) == 3
    for copy in taken:
        assert copy is not None and shared_snapshot(copy.model_copy()) is copy


def _reordered() -> CapabilitySnapshot:
    """The same schema as _snapshot()'s, its keys in another order."""
    text = _snapshot().model_dump_json()
    swapped = text.replace('"type":"object","properties"', '"properties"', 1).replace(
        '"maximum":10}}}', '"maximum":10}},"type":"object"}', 1
    )
    assert swapped != text
    return CapabilitySnapshot.model_validate_json(swapped)


def test_key_order_and_not_a_number_keep_a_run_s_own_copy() -> None:
    """Found by the second review: keyed by the store's canonical digest
    (sorted keys, NaN written as null), a made-up run's copy with its schema's
    keys reordered, or NaN where the honest one has null, was handed to
    honest runs, whose turns then sent the reordered schema to their model."""
    honest = _snapshot()
    assert shared_snapshot(honest) is honest
    reordered = _reordered()
    assert snapshot_digest(reordered) == snapshot_digest(honest)  # what joined them
    assert shared_snapshot(reordered) is reordered
    assert shared_snapshot(_snapshot()) is honest
    with_nan, with_null = _snapshot(bound=float("nan")), _snapshot(bound=None)  # type: ignore[arg-type]
    assert snapshot_digest(with_nan) == snapshot_digest(with_null)
    assert shared_snapshot(with_nan) is with_nan
    assert shared_snapshot(with_null) is with_null
    assert shared_snapshot(_snapshot(bound=float("nan"))) is not with_nan  # NaN: never shared


def test_what_only_python_code_can_build_is_not_shared_and_raises_nothing() -> None:
    """Found by the third review: a set, bytes or a lone surrogate in a
    schema (never decoded from JSON, only built in process) raised from the
    workflow's constructor."""
    for odd in ({"a"}, b"a", "\ud800"):
        spec = ToolSpec(
            name="t", description="d", side_effect="read", risk_level="R0", parameters={"x": odd}
        )
        snapshot = CapabilitySnapshot(tools=[spec], agents=[])
        assert value_text(snapshot) is None
        assert shared_snapshot(snapshot) is snapshot
    assert len(shared_snapshots._by_digest) == 0


def test_a_copy_leaves_the_table_with_the_last_run_holding_it() -> None:
    """Found by the second review: a table that kept its copies kept a made-up
    run's snapshot (up to Temporal's 2 MB payload, tens of MB in objects)
    after that run left the worker's cache."""
    held = shared_snapshot(_snapshot())
    assert len(shared_snapshots._by_digest) == 1
    for n in range(50):
        shared_snapshot(_snapshot(bound=n))  # nobody holds these
    gc.collect()
    assert list(shared_snapshots._by_digest.values()) == [held]
    del held
    gc.collect()
    assert len(shared_snapshots._by_digest) == 0


def test_a_snapshot_s_tools_and_grants_cannot_be_changed() -> None:
    snapshot = _snapshot()
    with pytest.raises(ValidationError):
        snapshot.tools = ()  # type: ignore[misc]
    with pytest.raises(ValidationError):
        snapshot.tools[0].risk_level = "R0"  # type: ignore[misc]
    with pytest.raises(ValidationError):
        snapshot.agents[0].tools = ("ticket_close",)  # type: ignore[misc]
    # What the review changed in place on the first version: tuples now.
    with pytest.raises(AttributeError):
        snapshot.agents[0].tools.append("ticket_delete")  # type: ignore[attr-defined]
    with pytest.raises(TypeError):
        snapshot.tools[0] = snapshot.tools[0]  # type: ignore[index]
    with pytest.raises(TypeError):
        snapshot.agents[0] = snapshot.agents[0]  # type: ignore[index]
    # The JSON, and so the digest the store pins, is the arrays it was.
    assert snapshot.model_dump(mode="json")["agents"] == [
        {"agent_id": "seat-1", "tools": ["ticket_update"]}
    ]


def _cached_runs() -> dict[str, RoundtableWorkflow]:
    """The runs the in-process worker holds now, by run id."""
    return {
        run.state.run_id: run for run in gc.get_objects() if isinstance(run, RoundtableWorkflow)
    }


async def test_two_waiting_runs_hold_one_snapshot_and_both_writes_still_run(tmp_path) -> None:
    one_write = script(("seat-1", 1, [ticket_call("ticket_get"), ticket_call("ticket_update")]))
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
        shared = first.state.snapshot
        as_opened = value_text(shared)
        assert as_opened is not None

        # Both decided before either result is awaited: awaiting a result
        # lets the time-skipping server jump to the other run's approval
        # expiry (stop 38's CI: "approval ... is not pending in this run").
        for handle, approval_id in zip(handles, approvals, strict=True):
            decision = Decision(approval_id=approval_id, decision="approved", decided_by="op-1")
            assert await handle.execute_update(RoundtableWorkflow.decide_approval, decision)
        for handle in handles:
            assert (await h.result(handle)).status == "completed"
            (action,) = await h.store.list_actions(handle.id)
            assert action["status"] == "succeeded"
        assert len(await h.tickets.write_log()) == 2
        # Nothing on the way (a read, decisions, writes, the seats told, the
        # runs' ends) changed the shared copy in place: its lists and schemas
        # are still mutable, and a change would reach every run holding it.
        # Compared as the table tells values apart (pydantic's JSON would
        # write a NaN put in place of a null as null again).
        assert value_text(shared) == as_opened
        threads = (await h.state(handles[0])).threads["seat-1"]
        told = [m.content for m in threads if m.role == "tool"]
        assert len(told) == 2, told  # the read's answer and the write's


def test_a_run_continued_as_new_takes_the_shared_copy_too() -> None:
    kept = shared_snapshot(_snapshot())
    carried = RunState(run_id="r1", snapshot=_snapshot(), snapshot_digest="d-carried")
    request = RunInput(run_id="r1", task_text="t", seats=["seat-1"])
    run = RoundtableWorkflow(WorkflowArgs(request=request, carried=carried))
    assert run.state.snapshot is kept


async def test_a_forged_carried_snapshot_never_reaches_an_honest_run(tmp_path) -> None:
    """The review's attack, end to end: a run started straight through
    Temporal with a made-up carried state whose snapshot differs from a real
    one only where Python's ``==`` cannot see it (a whole number written as a
    float). The honest run that opens afterwards keeps its own value, and
    its write is intercepted as usual, not refused as unpinned."""
    one_write = script(("seat-1", 1, [ticket_call("ticket_update")]))
    async with harness(tmp_path) as h:
        first = await h.start(task_text="t0", script=one_write)
        await h.wait_for(first, lambda s: bool(s.pending_approvals))
        real = _cached_runs()[first.id].state.snapshot
        assert real is not None
        text = real.model_dump_json()
        whole = re.search(r'":(\d+)([,}])', text)
        assert whole is not None, "the demo's schemas hold a whole number"
        floated = f'":{whole.group(1)}.0{whole.group(2)}'
        forged = CapabilitySnapshot.model_validate_json(
            text[: whole.start()] + floated + text[whole.end() :]
        )
        assert forged == real and snapshot_digest(forged) != snapshot_digest(real)

        shared_snapshots._by_digest.clear()
        request = RunInput(run_id="forged", task_text="t", seats=["seat-1"])
        carried = RunState(run_id="forged", snapshot=forged, snapshot_digest=snapshot_digest(real))
        RoundtableWorkflow(WorkflowArgs(request=request, carried=carried))

        second = await h.start(task_text="t1", script=one_write)
        state = await h.wait_for(second, lambda s: bool(s.pending_approvals))
        held = _cached_runs()[second.id].state.snapshot
        assert held is not None and held is not forged
        assert snapshot_digest(held) == state.snapshot_digest == snapshot_digest(real)
        (action,) = await h.store.list_actions(second.id)
        assert action["status"] == "waiting_approval"
