"""Gather what the invariant checker reads (roundtable/invariants.py) from the
real parts: the store, the ticket system's write log and Temporal."""

from __future__ import annotations

from collections.abc import Iterable

from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.service import RPCError, RPCStatusCode

from roundtable.invariants import Evidence
from roundtable.store import Store
from roundtable.tools.tickets import TicketSystem


async def gather(
    store: Store,
    tickets: TicketSystem,
    temporal: Client | None = None,
    started_runs: Iterable[str] | None = None,
) -> Evidence:
    """Read everything once the workload is quiet. ``started_runs``: the run
    ids the workload started (to find lost ones); ``temporal``: to compare
    which runs are closed."""
    runs = await store.list_runs()
    actions, approvals, events, chains = [], [], {}, {}
    for run in runs:
        actions += await store.list_actions(run["id"])
        approvals += await store.list_approvals(run_id=run["id"])
        events[run["id"]] = await store.list_events(run["id"])
        chains[run["id"]] = await store.verify_audit_chain(run["id"])
    closed = None
    if temporal is not None:
        closed = {run["id"]: await workflow_closed(temporal, run["id"]) for run in runs}
        closed = {run_id: state for run_id, state in closed.items() if state is not None}
    return Evidence(
        runs=runs,
        actions=actions,
        approvals=approvals,
        events=events,
        chains_ok=chains,
        ticket_writes=await tickets.write_log(),
        live_leases=await store.live_lease_action_ids(),
        started_runs=set(started_runs) if started_runs is not None else None,
        closed_in_temporal=closed,
    )


async def workflow_closed(temporal: Client, run_id: str) -> bool | None:
    """Whether the run's workflow is closed; None when Temporal has no such
    workflow (never started, or past retention), which says nothing."""
    try:
        described = await temporal.get_workflow_handle(run_id).describe()
    except RPCError as exc:
        if exc.status == RPCStatusCode.NOT_FOUND:
            return None
        raise
    return described.status not in (
        WorkflowExecutionStatus.RUNNING,
        WorkflowExecutionStatus.CONTINUED_AS_NEW,
    )
