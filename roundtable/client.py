"""The typed client for backend services: start runs, decide, reconcile, follow.

Everything a service needs is importable from here::

    from roundtable.client import RoundtableClient, RunInput

It speaks to Temporal directly (no HTTP hop, no database access); decisions
and reconciliations go through the run's workflow updates, so they meet the
same checks as the CLI and the HTTP API.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from datetime import UTC, datetime

from temporalio.client import Client
from temporalio.common import WorkflowIDReusePolicy
from temporalio.exceptions import WorkflowAlreadyStartedError

from roundtable import operations
from roundtable.config import load_settings
from roundtable.models import (
    Decision,
    DecisionInput,
    ReconcileInput,
    RunInput,
    RunResult,
    RunState,
    ScriptDocument,
    WorkflowArgs,
)
from roundtable.names import RUN_WORKFLOW, STATE_QUERY
from roundtable.permissions import Decider, attest
from roundtable.security import ActionSecretKeyError
from roundtable.store import AttemptMayBeRunningError, ConflictError, NotFoundError
from roundtable.temporal import connect

__all__ = [
    "AttemptMayBeRunningError",
    "ConflictError",
    "Decision",
    "DecisionInput",
    "NotFoundError",
    "ReconcileInput",
    "RoundtableClient",
    "RunHandle",
    "RunInput",
    "RunResult",
    "RunState",
    "ScriptDocument",
]


@dataclass
class RunHandle:
    client: RoundtableClient
    run_id: str

    @property
    def workflow_id(self) -> str:
        return self.run_id

    async def state(self) -> RunState:
        return await self.client.state(self.run_id)

    async def result(self) -> RunResult:
        return await self.client.result(self.run_id)

    async def decide(
        self,
        approval_id: str,
        decision: str,
        *,
        decided_by: str,
        reason: str | None = None,
        arguments_digest: str | None = None,
        idempotency_key: str | None = None,
    ) -> str:
        return await self.client.decide(
            self.run_id,
            approval_id,
            decision,
            decided_by=decided_by,
            reason=reason,
            arguments_digest=arguments_digest,
            idempotency_key=idempotency_key,
        )

    async def reconcile(
        self, action_id: str, outcome: str, *, decided_by: str, note: str | None = None
    ) -> str:
        return await self.client.reconcile(
            self.run_id, action_id, outcome, decided_by=decided_by, note=note
        )


class RoundtableClient:
    def __init__(self, temporal: Client, task_queue: str = "roundtable") -> None:
        self.temporal = temporal
        self.task_queue = task_queue

    @classmethod
    async def connect(
        cls,
        address: str | None = None,
        namespace: str | None = None,
        task_queue: str | None = None,
    ) -> RoundtableClient:
        """Defaults come from ROUNDTABLE_TEMPORAL_ADDRESS, _NAMESPACE and _TASK_QUEUE;
        TLS, the client certificate and the API key always from the settings
        (README, "Production: connecting to a Temporal cluster")."""
        settings = load_settings()
        chosen = {"temporal_address": address, "temporal_namespace": namespace}
        settings = settings.model_copy(update={k: v for k, v in chosen.items() if v})
        temporal = await connect(settings)
        return cls(temporal, task_queue or settings.task_queue)

    async def start_run(self, request: RunInput) -> RunHandle:
        """Start a run; ``request.run_id`` makes the start idempotent: the same
        request again returns the same run and starts nothing, even after the
        run has finished; another request under that id is a ConflictError."""
        run_id = request.run_id or operations.new_run_id()
        request = request.model_copy(update={"run_id": run_id})
        fingerprint = operations.request_fingerprint(request)
        try:
            await self.temporal.start_workflow(
                RUN_WORKFLOW,
                WorkflowArgs(request=request),
                id=run_id,
                task_queue=self.task_queue,
                id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
                memo={operations.FINGERPRINT_MEMO: fingerprint},
                static_summary=f"Roundtable: {request.task_text[:100]}",
            )
        except WorkflowAlreadyStartedError:
            await operations.same_request_or_conflict(self.temporal, run_id, fingerprint)
        return RunHandle(self, run_id)

    def handle(self, run_id: str) -> RunHandle:
        return RunHandle(self, run_id)

    async def state(self, run_id: str) -> RunState:
        return await self.temporal.get_workflow_handle(run_id).query(
            STATE_QUERY, result_type=RunState
        )

    async def result(self, run_id: str) -> RunResult:
        return await self.temporal.get_workflow_handle(run_id, result_type=RunResult).result()

    async def decide(
        self,
        run_id: str,
        approval_id: str,
        decision: str,
        *,
        decided_by: str,
        reason: str | None = None,
        arguments_digest: str | None = None,
        idempotency_key: str | None = None,
    ) -> str:
        """Approve or reject; ConflictError when the approval is no longer
        pending. ``idempotency_key``: the service's name for this request;
        sent again (its answer lost) with the same arguments while the run
        is open, it is answered as the first was and decides nothing again
        (operations.idempotent_request_id). The update is named by the
        request itself, so Temporal answers it with the first attempt's
        outcome, a refusal too: this client cannot read the store for the
        record, as the API does. A request refused for a passing reason is
        sent again under a new key (a new decision on an approval already
        decided is a conflict, never a second decision)."""
        update_id = None
        if idempotency_key is not None:
            asked = {"decision": decision, "reason": reason, "arguments_digest": arguments_digest}
            update_id = operations.idempotent_request_id(
                "decide", decided_by, approval_id, idempotency_key, {**asked, "arguments": None}
            )
        return await operations.send_update(
            self.temporal,
            run_id,
            operations.DECIDE_UPDATE,
            Decision(
                approval_id=approval_id,
                decision=decision,
                decided_by=decided_by,
                reason=reason,
                arguments_digest=arguments_digest,
            ),
            update_id=update_id,
        )

    async def reconcile(
        self,
        run_id: str,
        action_id: str,
        outcome: str,
        *,
        decided_by: str,
        note: str | None = None,
    ) -> str:
        """Settle an unknown action of this run, whatever state the run's
        workflow is in; ConflictError (AttemptMayBeRunningError, with
        ``retry_at``) while its attempt may still be running."""
        request = ReconcileInput(
            action_id=action_id,
            outcome=outcome,
            decided_by=decided_by,
            note=note,
            request_id=operations.new_request_id(),
        )
        # Reconciling is for operators. A client that holds the action secret
        # is part of the server and may vouch for one; without it the worker
        # refuses (reconcile through the API or CLI instead).
        with contextlib.suppress(ActionSecretKeyError):
            request = attest(
                request, Decider(user_id=decided_by, role="operator"), datetime.now(UTC)
            )
        status, _ = await operations.reconcile_request(
            self.temporal, run_id, request, self.task_queue
        )
        return status
