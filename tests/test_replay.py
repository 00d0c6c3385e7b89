"""Recorded histories replay on today's workflow code.

A change that would break runs already in flight (a non-deterministic change)
fails here. Record into a new directory, beside the old ones, never over them:
    ROUNDTABLE_RECORD_HISTORIES=tests/histories/<new directory> .venv/bin/pytest <the tests>
"""

from __future__ import annotations

from pathlib import Path

import pytest
from temporalio.client import WorkflowHistory

from roundtable.workflow_runner import strict_runner, workflow_runner
from tests.replaying import replay_failure

# Histories are never changed once recorded: a running workflow would break the
# same way. At the top level, runs of this code's tests from before the
# handlers patch; in recorded-on-16ead1e/, runs from before the safety rules
# changed; in recorded-with-handlers-patch/, the same tests recorded once runs
# waited for their message handlers (workflow.patched keeps each generation on
# its own path: every one must replay to the end; recorded-before-handlers-patch/
# keeps the pre-patch runs at the path an earlier change gave them too); in
# recorded-with-lean-status/,
# once a write's intercept and decision carried the run's status; in
# recorded-with-waking-writes/, once a refresh woke a write waiting for its
# target (the timer it waited on cancelled); in recorded-with-worker-roles/,
# runs whose tool calls went to a tool worker's queue; in
# recorded-with-per-write-blocked/, runs that keep one blocked reason a write;
# in recorded-with-timer-decisions/, runs where only fired timers end an
# approval's waits (tests/test_replay_clock.py also replays these with their
# clocks moved); in recorded-with-sweep-and-reconcile/, the sweep's and the
# reconciliation's own workflows (and the runs they served); in
# recorded-with-one-rules-marker/, runs that ask for one patch standing for
# every rule above (rules-as-of-2026-12) instead of one patch a rule; in
# recorded-with-kept-snapshots/, runs whose store keeps their snapshot, so
# their opening's result and state name its digest (the same command order:
# no patch; replay guards that the models still read them, not which form a
# turn is sent in: activity inputs are not compared); in
# recorded-with-keyed-requests/, runs decided and extended under an
# Idempotency-Key, whose updates are named "<request>/<attempt>" (the same
# command order: no patch; the change is recorded under the request); in
# recorded-before-decision-by-request/, runs whose decision failed on a tool
# worker and answered from the approval's status alone, and in
# recorded-with-decision-by-request/, the same runs (and a signal's) answering
# from their request's own record, the seat told of the approval's edits
# (decision-fallback-by-request); in recorded-before-reconcile-by-request/,
# runs whose reconciliation failed on a tool worker and answered from the
# action's status alone, and in recorded-with-reconcile-by-request/, the same
# runs answering from their request's own record
# (reconcile-fallback-by-request).
# A new command order
# adds a new directory; it never rewrites one.
HISTORIES = {
    f"{path.parent.name}/{path.stem}": path.read_text()
    for path in sorted((Path(__file__).parent / "histories").glob("**/*.json"))
}


def test_enough_histories_are_recorded() -> None:
    assert len(HISTORIES) >= 2


# The worker's runner, and the SDK's strict sandbox: the worker runs outside
# the sandbox (roundtable/workflow_runner.py), so each recorded run replays in
# it here too (as every run a test starts does, tests/workflow_harness.py). The
# sandbox watches the modules under workflows/; what they pass through
# (roundtable's models, names and states, the context budget, activities'
# types) runs unwatched by it, and tests/test_workflow_determinism.py reads
# that code for the same rules instead.
RUNNERS = {"worker": workflow_runner, "sandboxed": strict_runner}


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("name", HISTORIES)
async def test_history_replays(name: str, runner: str) -> None:
    history = WorkflowHistory.from_json(name, HISTORIES[name])
    failure = await replay_failure(history, RUNNERS[runner]())
    assert failure is None, failure
