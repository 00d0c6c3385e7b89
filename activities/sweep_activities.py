"""The sweep: expire overdue approvals and recover lapsed leases for runs whose
workflow is gone or stuck. Idempotent: a second run, or a concurrent one, finds
nothing left to change."""

from __future__ import annotations

from temporalio import activity

from roundtable.models import Model
from roundtable.store import Store


class SweepOutput(Model):
    expired_approvals: list[str]
    unknown_actions: list[str]
    run_ids: list[str]


class SweepActivities:
    def __init__(self, store: Store) -> None:
        self.store = store

    @activity.defn(name="sweep_store")
    async def sweep_store(self) -> SweepOutput:
        expired = await self.store.expire_due_approvals()
        recovered = await self.store.recover_expired_action_leases()
        runs = sorted({e["run_id"] for e in expired} | {a["run_id"] for a in recovered})
        return SweepOutput(
            expired_approvals=[e["id"] for e in expired],
            unknown_actions=[a["id"] for a in recovered],
            run_ids=runs,
        )
