"""A starved pool at each store call of a write's execution and settling
(from the review of the pool sizing, 2026-12-06): the call's checkout times
out (sqlalchemy.exc.TimeoutError, what a pool too small raises). The
promises hold: the tool runs at most once; an outcome that may have
happened is `unknown`; one that surely did not leaves the write approved,
and it runs later; a recorded outcome is never overwritten."""

from __future__ import annotations

import pytest
from sqlalchemy.exc import TimeoutError as PoolTimeout

from roundtable.config import PoolSizing
from roundtable.models import Decision
from tests.workflow_harness import harness, script, ticket_call
from workflows.roundtable import RoundtableWorkflow

ONE = PoolSizing(size=1, overflow=0, timeout_seconds=10.0)


def _starve(store, name: str, fail_calls: set[int]) -> list[int]:  # type: ignore[no-untyped-def]
    real = getattr(store, name)
    calls: list[int] = []

    async def starved(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        if len(calls) in fail_calls:
            raise PoolTimeout("QueuePool limit of size 1 overflow 0 reached, connection timed out")
        return await real(*args, **kwargs)

    setattr(store, name, starved)
    return calls


# (store call, which of its calls fail, the action's end, times the tool wrote)
CASES = [
    ("claim_for_execution", {1}, "succeeded", 1),
    ("record_action_terminal_result", {1}, "unknown", 1),
    ("record_action_terminal_result", {1, 2}, "unknown", 1),  # settle's first try too
    ("runs_waiting_on_target", {1}, "succeeded", 1),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("call", "fail", "status", "writes"), CASES)
async def test_a_starved_pool_at_each_write_step(
    tmp_path, postgres_url, call, fail, status, writes
) -> None:
    calls = script(("seat-1", 1, [ticket_call("ticket_update", "T-1")]))
    async with harness(tmp_path, database_url=postgres_url, pool=ONE) as h:
        handle = await h.start(task_text="t", script=calls)
        state = await h.wait_for(handle, lambda s: bool(s.pending_approvals))
        (approval_id,) = state.pending_approvals
        seen = _starve(h.store, call, fail)
        await handle.execute_update(
            RoundtableWorkflow.decide_approval,
            Decision(approval_id=approval_id, decision="approved", decided_by="op-1"),
        )
        if status == "unknown":
            await h.wait_for(handle, lambda s: bool(s.unknown_actions))
        else:
            await handle.result()
        assert seen, f"{call} was never called"
        (action,) = await h.store.list_actions(handle.id)
        log = await h.tickets.write_log()
        assert action["status"] == status, action
        assert len(log) == writes, log
        assert await h.store.verify_audit_chain(handle.id)
        if status == "unknown":
            await handle.terminate()
