"""SweepWorkflow: started by a Temporal Schedule; nudges live runs it changed."""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow
from temporalio.exceptions import ApplicationError

with workflow.unsafe.imports_passed_through():
    from activities.sweep_activities import SweepActivities, SweepOutput
    from roundtable.names import REFRESH_SIGNAL


@workflow.defn(name="RoundtableSweepWorkflow")
class SweepWorkflow:
    @workflow.run
    async def run(self) -> SweepOutput:
        swept = await workflow.execute_activity_method(
            SweepActivities.sweep_store,
            start_to_close_timeout=timedelta(minutes=5),
            summary="expire overdue approvals, recover lapsed leases",
        )
        for run_id in swept.run_ids:
            try:
                await workflow.get_external_workflow_handle(run_id).signal(REFRESH_SIGNAL)
            except ApplicationError:
                # The run's workflow is gone; the store already holds the truth.
                workflow.logger.info("run %s has no live workflow to nudge", run_id)
        return swept
