"""A run's history stays bounded however many writes it makes: five hundred
writes, and no history of the run (it continues as new when the server
suggests it, between rounds) reaches ten thousand events. On the real dev
server, whose suggestion is the one production gets. Both ways a write
goes: approved by the run's policy, and approved by a person, whose write
adds the most events (the approval's timer, the decision's update)."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import pytest
from temporalio.client import WorkflowHandle
from temporalio.service import RPCError

from tests.test_kept_snapshots import scheduled_inputs
from tests.test_workflow_approvals import decide
from tests.workflow_harness import Harness, harness, script, ticket_call
from workflows.roundtable import RoundtableWorkflow

ROUNDS, WRITES_PER_TURN = 50, 10  # 500 writes, ten at a time, each on its own ticket
HISTORY_BOUND = 10_000


def _many_writes() -> dict[str, Any]:
    turns = [
        (
            "seat-1",
            r,
            [ticket_call("ticket_comment", f"T-{r}-{i}") for i in range(WRITES_PER_TURN)],
        )
        for r in range(1, ROUNDS + 1)
    ]
    return script(*turns)


async def _start(h: Harness, write_policy: str) -> WorkflowHandle:
    return await h.start(
        task_text="many writes",
        seats=["seat-1"],
        manager=None,
        max_rounds=ROUNDS,
        write_policy=write_policy,
        script=_many_writes(),
    )


async def _every_history_bounded(h: Harness, handle: WorkflowHandle) -> None:
    """Each write ran once and succeeded; the run continued as new at least
    once, and each of its histories stayed under the bound."""
    actions = await h.store.list_actions(handle.id)
    assert len(actions) == ROUNDS * WRITES_PER_TURN
    assert Counter(a["status"] for a in actions) == {"succeeded": len(actions)}
    assert {a["attempt_count"] for a in actions} == {1}
    writes = await h.tickets.write_log()
    assert len(writes) == len(actions)
    assert len({w["idempotency_key"] for w in writes}) == len(actions)  # each once

    runs = [w async for w in h.client.list_workflows(f"WorkflowId = '{handle.id}'")]
    sizes, named = [], set()
    digest = (await h.store.get_run(handle.id))["snapshot_digest"]
    for run in runs:
        one = h.client.get_workflow_handle(handle.id, run_id=run.run_id)
        sizes.append(len((await one.fetch_history()).events))
        # The kept snapshot's digest goes with the state into each run.
        turns = await scheduled_inputs(one, h.client.data_converter)
        named |= {t.get("tools_of") for t in turns}
    assert named == {digest}
    assert len(runs) >= 2, f"one history of {sizes} events: it never continued as new"
    assert max(sizes) < HISTORY_BOUND, sizes


@pytest.mark.timeout(600)
async def test_five_hundred_writes_keep_every_history_under_ten_thousand_events(tmp_path) -> None:
    async with harness(tmp_path, dev_server=True) as h:
        handle = await _start(h, "auto_approve_up_to:R1")
        assert (await handle.result()).status == "completed"  # follows continue-as-new
        await _every_history_bounded(h, handle)


async def _approve_all(h: Harness, run_id: str, finished: asyncio.Task) -> set[str]:
    """Approve each write as it waits, as an operator would, until the run
    ends: on the run's latest execution, whichever continued-as-new one
    that is. The approvals decided."""
    latest = h.client.get_workflow_handle(run_id)
    decided: set[str] = set()
    while not finished.done():
        try:
            state = await latest.query(RoundtableWorkflow.state)
        except RPCError:  # between one execution and the next
            await asyncio.sleep(0.05)
            continue
        waiting = [a for a in state.pending_approvals if a not in decided]
        outcomes = await asyncio.gather(*(decide(latest, a, "approved") for a in waiting))
        assert set(outcomes) <= {"approved"}, outcomes
        decided |= set(waiting)
        await asyncio.sleep(0.05)
    return decided


@pytest.mark.timeout(600)
async def test_five_hundred_approved_writes_keep_every_history_under_ten_thousand_events(
    tmp_path,
) -> None:
    async with harness(tmp_path, dev_server=True) as h:
        handle = await _start(h, "confirm_all_writes")
        finished = asyncio.ensure_future(h.result(handle, within=540))
        decided = await _approve_all(h, handle.id, finished)
        assert (await finished).status == "completed"
        assert len(decided) == ROUNDS * WRITES_PER_TURN
        await _every_history_bounded(h, handle)
        # Every write went by a person's decision, each its own approval.
        for action in await h.store.list_actions(handle.id):
            approval = await h.store.get_approval(action["approval_id"])
            assert (approval["status"], approval["decided_by"]) == ("approved", "op-1")
            decided.remove(action["approval_id"])
        assert not decided
