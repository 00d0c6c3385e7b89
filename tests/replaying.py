"""One way to replay a history for the tests: every workflow the worker
serves, the project's converter unless a test holds other keys."""

from __future__ import annotations

from temporalio.client import WorkflowHistory
from temporalio.converter import DataConverter
from temporalio.worker import Replayer, WorkflowRunner

from roundtable.temporal import data_converter
from worker import WORKFLOWS


async def replay_failure(
    history: WorkflowHistory, runner: WorkflowRunner, converter: DataConverter | None = None
) -> Exception | None:
    """Why ``history`` does not replay on ``runner``, or None if it does."""
    replayer = Replayer(
        workflows=list(WORKFLOWS),
        data_converter=converter or data_converter(),
        workflow_runner=runner,
    )
    result = await replayer.replay_workflow(history, raise_on_replay_failure=False)
    return result.replay_failure
