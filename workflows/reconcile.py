"""ReconcileWorkflow: settle an unknown action in the store, for callers that
speak only to Temporal (the typed client) when the run's own workflow is
closed or not waiting on the action; then nudge the run, if it is open."""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ApplicationError

with workflow.unsafe.imports_passed_through():
    from activities.write_activities import WriteActivities
    from roundtable.models import ReconcileOutput, ReconcileRequest
    from roundtable.names import RECONCILE_WORKFLOW, REFRESH_SIGNAL


@workflow.defn(name=RECONCILE_WORKFLOW)
class ReconcileWorkflow:
    @workflow.run
    async def run(self, request: ReconcileRequest) -> ReconcileOutput:
        # Once: the caller may simply ask again. (An attempt whose answer was
        # lost after its commit finds its own record in the store and says so:
        # store/reconcile_requests.py.)
        out = await workflow.execute_activity_method(
            WriteActivities.reconcile_for_run,
            request,
            start_to_close_timeout=timedelta(seconds=30),
            retry_policy=RetryPolicy(maximum_attempts=1),
            summary=f"reconcile {request.reconcile.action_id} in the store",
            # On a tool worker serving the action's tool when tool workers do
            # (only it can fence the target); else on this workflow's queue.
            **({"task_queue": request.tool_queue} if request.tool_queue else {}),
        )
        if out.conflict is None:
            try:
                await workflow.get_external_workflow_handle(request.run_id).signal(REFRESH_SIGNAL)
            except ApplicationError:
                workflow.logger.info("run %s has no live workflow to nudge", request.run_id)
        return out
