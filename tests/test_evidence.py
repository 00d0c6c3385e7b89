"""The invariant checker over real parts: what a real run leaves in the store,
the ticket log and Temporal passes; an operator's wrong guess is caught."""

from __future__ import annotations

import pytest
from temporalio.client import WorkflowUpdateFailedError

from roundtable.evidence import gather
from roundtable.invariants import check, summary
from roundtable.models import Decision, RunResult
from tests.test_closed_runs import AUTO, acts_then_raises, update
from tests.test_workflow_execution import reconcile, wrap_tool
from tests.workflow_harness import harness
from workflows.roundtable import RoundtableWorkflow


async def test_real_runs_leave_no_violations_and_a_wrong_guess_is_caught(tmp_path) -> None:
    async with harness(
        tmp_path, customize=lambda reg, _t: wrap_tool(reg, "ticket_update", acts_then_raises)
    ) as h:
        # The first writer of T-1 applies its write, then loses the answer: unknown.
        lost = await h.start(task_text="t", script=update("T-1", "a"), write_policy=AUTO)
        state = await h.wait_for(lost, lambda s: bool(s.unknown_actions))
        (unknown_id,) = state.unknown_actions
        # A person approves another write, to another ticket.
        approved = await h.start(task_text="t", script=update("T-2", "b"))
        state = await h.wait_for(approved, lambda s: bool(s.pending_approvals))
        (approval_id,) = state.pending_approvals
        await approved.execute_update(
            RoundtableWorkflow.decide_approval,
            Decision(approval_id=approval_id, decision="approved", decided_by="op-1"),
        )
        # The lost run waits with no timer of its own, so a time-skipping
        # wait would jump to its 10-year execution timeout and close it.
        with h.env.auto_time_skipping_disabled():
            assert (await approved.result()).status == "completed"

        # While the unknown waits, that is no violation: nothing was guessed.
        started = {lost.id, approved.id}
        evidence = await gather(h.store, h.tickets, h.client, started)
        assert check(evidence) == [], check(evidence)

        # The operator guesses "failed" without looking: the ticket's fence
        # sees the write applied and refuses.
        with pytest.raises(WorkflowUpdateFailedError):
            await reconcile(lost, unknown_id, "failed")
        # A tool without a fence could not tell: the store takes the guess.
        await h.store.reconcile_action(unknown_id, "failed", "op-1", "guessed")
        await lost.signal(RoundtableWorkflow.refresh)
        finished = h.client.get_workflow_handle(lost.id, result_type=RunResult)
        await finished.result()
        evidence = await gather(h.store, h.tickets, h.client, started | {"run-never-made"})
        violations = check(evidence)
        assert {(v.rule, v.subject) for v in violations} == {
            (4, unknown_id),
            (7, "run-never-made"),
        }, violations
        assert summary(evidence, violations, faults=0).endswith("violations=2")


def test_roundtable_check_prints_the_summary_and_fails_on_a_violation(tmp_path) -> None:
    import asyncio
    import os
    import subprocess
    import sys
    from pathlib import Path

    from roundtable.store import open_store

    url = f"sqlite+aiosqlite:///{tmp_path / 'rt.db'}"
    env = {**os.environ, "ROUNDTABLE_DATABASE_URL": url}
    cli = [str(Path(sys.executable).parent / "roundtable"), "check", "--no-temporal"]

    def run() -> subprocess.CompletedProcess[str]:
        return subprocess.run(cli, env=env, capture_output=True, text=True, timeout=60, check=False)

    upgraded = subprocess.run(
        [*cli[:1], "db", "upgrade"], env=env, capture_output=True, timeout=60, check=False
    )
    assert upgraded.returncode == 0, upgraded.stderr
    clean = run()
    assert clean.returncode == 0, clean.stderr
    assert clean.stdout.strip() == "runs=0 actions=0 faults=0 violations=0"

    async def stuck_run() -> None:  # waiting for nothing: a lost run in the making
        async with open_store(url) as store:
            run = await store.ensure_run(run_id="run-x", user_id="u", task_text="t")
            await store.set_run_status(run["id"], "running")
            await store.set_run_status(run["id"], "waiting_input")

    asyncio.run(stuck_run())
    broken = run()
    assert broken.returncode == 1
    assert "rule 7 · run-x: waiting_input with nothing to wait for" in broken.stdout
    assert broken.stdout.strip().endswith("violations=1")
