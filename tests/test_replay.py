"""Recorded histories replay on today's workflow code.

A change that would break runs already in flight (a non-deterministic change)
fails here. Re-record deliberately, and only with a versioning plan:
    ROUNDTABLE_RECORD_HISTORIES=tests/histories .venv/bin/pytest <the recorded tests>
"""

from __future__ import annotations

from pathlib import Path

import pytest
from temporalio.client import WorkflowHistory
from temporalio.worker import Replayer

from roundtable.temporal import data_converter
from workflows.roundtable import RoundtableWorkflow
from workflows.sweep import SweepWorkflow

# Histories of this code's own tests; in recorded-on-16ead1e/ histories of runs
# made by the code before the safety rules changed, and in
# recorded-before-handlers-patch/ those made before runs waited for their
# message handlers to finish (workflow.patched keeps such runs on their old
# behaviour: they must replay to the end).
HISTORIES = {
    f"{path.parent.name}/{path.stem}": path.read_text()
    for path in sorted((Path(__file__).parent / "histories").glob("**/*.json"))
}


def test_enough_histories_are_recorded() -> None:
    assert len(HISTORIES) >= 2


@pytest.mark.parametrize("name", HISTORIES)
async def test_history_replays(name: str) -> None:
    replayer = Replayer(
        workflows=[RoundtableWorkflow, SweepWorkflow], data_converter=data_converter()
    )
    history = WorkflowHistory.from_json(name, HISTORIES[name])
    result = await replayer.replay_workflow(history, raise_on_replay_failure=False)
    assert result.replay_failure is None, result.replay_failure
