"""One way to replay a history for the tests: every workflow the worker
serves, the project's converter unless a test holds other keys."""

from __future__ import annotations

from temporalio.client import WorkflowHistory
from temporalio.converter import DataConverter
from temporalio.worker import Replayer, WorkflowRunner
from temporalio.workflow import NondeterminismError

from roundtable.temporal import data_converter
from worker import WORKFLOWS


async def replay_failure(
    history: WorkflowHistory, runner: WorkflowRunner, converter: DataConverter | None = None
) -> Exception | None:
    """Why ``history`` does not replay on ``runner``, or None if it does.

    A failure other than a nondeterminism is replayed once more: the SDK
    fails an activation that has not yielded within two seconds (its
    deadlock detector), which a loaded machine has reached once in a CI
    rehearsal (2026-12-06: ``_DeadlockError`` in a history that replays in
    under a second alone, its workflow thread at an ordinary await). A real
    divergence fails every replay, so it still fails here."""
    replayer = Replayer(
        workflows=list(WORKFLOWS),
        data_converter=converter or data_converter(),
        workflow_runner=runner,
    )
    result = await replayer.replay_workflow(history, raise_on_replay_failure=False)
    failure = result.replay_failure
    if failure is None or isinstance(failure, NondeterminismError):
        return failure
    print(f"replay of {history.workflow_id} failed, replayed once more: {failure!r}")
    again = await replayer.replay_workflow(history, raise_on_replay_failure=False)
    return again.replay_failure
