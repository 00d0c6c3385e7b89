"""The Roundtable worker: wires the store, tools and activities to Temporal.

Run it as ``roundtable worker`` (or ``python worker.py``). By role
(``ROUNDTABLE_WORKER_ROLE``, README "Worker roles"):

- ``all``: workflows and every activity on the task queue, tools included;
- ``workflows``: workflows and the store's bookkeeping on the task queue; no
  tool code, no tool credentials; runs route tool calls to tool workers;
- ``tools``: only the activities that need a tool, on the tool task queue
  (or, limited to some tools, on a queue of each tool's own), publishing the
  tools it serves in the store's catalog.

A worker running workflows also makes sure the sweep schedule exists when the
sweep is enabled.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from temporalio.client import (
    Client,
    Schedule,
    ScheduleActionStartWorkflow,
    ScheduleAlreadyRunningError,
    ScheduleIntervalSpec,
    ScheduleOverlapPolicy,
    SchedulePolicy,
    ScheduleSpec,
)
from temporalio.service import RPCError, RPCStatusCode
from temporalio.worker import Worker

from activities.run_activities import RunActivities
from activities.sweep_activities import SweepActivities
from activities.webhook_activities import WebhookActivities
from activities.write_activities import WriteActivities
from roundtable.config import Settings, load_settings
from roundtable.names import SWEEP_SCHEDULE_ID
from roundtable.permissions import Authority
from roundtable.security import read_action_secret
from roundtable.store import Store, open_store
from roundtable.telemetry.gauges import recounting
from roundtable.telemetry.metrics import Metrics
from roundtable.telemetry.runtime import metrics_runtime
from roundtable.telemetry.tracing import start_tracing
from roundtable.temporal import connect
from roundtable.tools.registry import ToolRegistry
from roundtable.webhooks import signing_key
from roundtable.workflow_runner import workflow_runner
from workflows.reconcile import ReconcileWorkflow
from workflows.roundtable import RoundtableWorkflow
from workflows.sweep import SweepWorkflow

log = logging.getLogger("roundtable.worker")
STICKY_QUEUE_TIMEOUT = timedelta(seconds=1)
SHUTDOWN_GRACE = timedelta(seconds=30)
# Every workflow a worker serves; the replay tests replay them all.
WORKFLOWS = (RoundtableWorkflow, SweepWorkflow, ReconcileWorkflow)


@dataclass
class WorkerParts:
    store: Store
    registry: ToolRegistry
    tickets: Any  # the demo TicketSystem; None on a workflows worker


@dataclass
class WebhookConfig:
    urls: list[str]
    signing_key: bytes
    expiring_lead_seconds: int = 300

    @classmethod
    def from_settings(cls, settings: Settings) -> WebhookConfig | None:
        if not settings.webhook_urls:
            return None
        secret = settings.webhook_secret or read_action_secret().decode()
        return cls(
            list(settings.webhook_urls),
            signing_key(secret),
            settings.approval_expiring_lead_seconds,
        )


def build_worker(
    client: Client,
    task_queue: str,
    store: Store,
    registry: ToolRegistry,
    webhooks: WebhookConfig | None = None,
    authority: Authority | None = None,
    metrics: Metrics | None = None,
    role: str = "all",
    **worker_options: Any,
) -> Worker:
    """The worker for these parts, in ``role`` (all, workflows or tools) on
    ``task_queue``; ``worker_options`` go to temporalio's Worker.
    ``authority``: who may ask for what (default: from the environment);
    ``metrics``: where to record ours (default: nowhere)."""
    authority = authority or Authority.from_settings(load_settings())
    metrics = metrics or Metrics()
    if metrics.committed not in store.db.observers:
        store.db.observers.append(metrics.committed)
    runs = RunActivities(
        store,
        registry,
        webhooks.urls if webhooks else [],
        webhooks.expiring_lead_seconds if webhooks else 300,
        authority=authority,
        metrics=metrics,
        catalog=role == "workflows",
    )
    writes = WriteActivities(
        store,
        registry,
        client,
        authority=authority,
        metrics=metrics,
        tools_here=role != "workflows",
    )
    # What needs a tool's code: on a tool worker, and on a worker doing all.
    tool_activities = [
        runs.run_read_tool,
        writes.intercept_write,
        writes.execute_write,
        writes.decide_approval,
        writes.reconcile_action,
        writes.reconcile_for_run,
    ]
    options: dict[str, Any] = {
        # When a worker dies, its runs' next workflow task waits this long on
        # the dead worker's sticky queue before any other worker may take it:
        # the SDK's 10 s default made "crash → unknown" heartbeat + ~10 s.
        "sticky_queue_schedule_to_start_timeout": STICKY_QUEUE_TIMEOUT,
        # On shutdown (a deploy, Ctrl-C), writes under way get this long to
        # finish before they are cancelled (and would then end unknown).
        "graceful_shutdown_timeout": SHUTDOWN_GRACE,
        **worker_options,
    }
    if role == "tools":
        return Worker(client, task_queue=task_queue, **options, activities=tool_activities)
    sweep = SweepActivities(store)
    # Without receivers no run ever asks for a delivery, so no key is needed.
    hooks = WebhookActivities(
        store, webhooks.signing_key if webhooks else b"", urls=webhooks.urls if webhooks else []
    )
    bookkeeping = [
        runs.ensure_run,
        runs.take_turn,
        runs.set_run_status,
        writes.extend_approval,
        writes.expire_approval,
        writes.approval_status,
        writes.request_decision,
        writes.settle_write,
        writes.withdraw_write,
        writes.withdraw_call,
        writes.action_status,
        writes.reconciled_by_request,
        writes.signal_sender,
        sweep.sweep_store,
        hooks.deliver_webhook,
    ]
    if role == "workflows":
        # The intercept, a decision and a reconciliation stay registered as
        # local activities of runs whose tools are here (none on this worker:
        # they refuse rather than guess); reads and writes never run here.
        here = [writes.intercept_write, writes.decide_approval, writes.reconcile_action]
        here.append(writes.reconcile_for_run)
    else:
        here = tool_activities
    # Outside the sandbox unless the caller says otherwise
    # (roundtable/workflow_runner.py says why and what checks our workflow
    # code instead).
    options.setdefault("workflow_runner", workflow_runner())
    return Worker(
        client,
        task_queue=task_queue,
        **options,
        workflows=list(WORKFLOWS),
        activities=[*bookkeeping, *here],
    )


def tool_queues(settings: Settings, registry: ToolRegistry) -> dict[str, list[str]]:
    """A tool worker's task queues and the tools each serves: the tool task
    queue for all of them, or, limited to some tools, a queue of each tool's
    own (another worker on the shared queue may lack a tool a run calls)."""
    named = settings.served_tools()
    if settings.worker_tools.strip() and not named:
        raise ValueError(f"ROUNDTABLE_WORKER_TOOLS={settings.worker_tools!r} names no tool")
    if not named and settings.tool_queue() == settings.task_queue:
        raise ValueError(
            f"a tools worker needs a task queue of its own: set ROUNDTABLE_TOOL_TASK_QUEUE "
            f"(say roundtable-tools) to another queue than {settings.task_queue!r}, where "
            "workflows workers would take its calls and refuse them"
        )
    unknown = sorted(set(named) - set(registry.tools))
    if unknown:
        raise ValueError(
            f"ROUNDTABLE_WORKER_TOOLS names tools this worker does not have: {', '.join(unknown)}"
            f" (it has: {', '.join(sorted(registry.tools)) or 'none'})"
        )
    if not named:
        return {settings.tool_queue(): sorted(registry.tools)}
    return {own_queue(settings, name): [name] for name in named}


def own_queue(settings: Settings, tool_name: str) -> str:
    """The task queue of a tool served by workers limited to some tools."""
    return f"{settings.tool_queue()}/{tool_name}"


@asynccontextmanager
async def worker_parts(settings: Settings) -> AsyncIterator[WorkerParts]:
    """The store, the demo ticket system and a registry holding its tools and
    those of the MCP servers, whose sessions stay open until these parts close.
    A workflows worker gets the store alone: no tool code is even imported."""
    async with open_store(settings.database_url, pool=settings.database_pool()) as store:
        if settings.worker_role == "workflows":
            yield WorkerParts(store=store, registry=ToolRegistry(), tickets=None)
            return
        from roundtable.tools.mcp import load_config, register_mcp_tools
        from roundtable.tools.mcp_sessions import MCPSessions
        from roundtable.tools.tickets import TicketSystem, register_ticket_tools

        tickets = await TicketSystem.open(
            settings.tickets_url(),
            settings.demo_ticket_write_delay_seconds,
            frozenset(settings.demo_ticket_drop_after_write),
        )
        try:
            # Closed after the worker stopped (run_worker enters the worker
            # inside these parts): no call is under way when its server goes.
            async with MCPSessions() as sessions:
                registry = ToolRegistry()
                register_ticket_tools(registry, tickets)
                if settings.mcp_config:
                    specs = load_config(settings.mcp_config)
                    added = await register_mcp_tools(registry, specs, sessions)
                    log.info("tools from MCP servers: %s", ", ".join(added) or "none")
                yield WorkerParts(store=store, registry=registry, tickets=tickets)
        finally:
            await tickets.close()


async def ensure_sweep_schedule(client: Client, settings: Settings) -> str:
    """Make the sweep schedule match ``settings.sweep_enabled``: enabled, it is
    created once (or resumed if paused); disabled, an existing one is paused
    (never created). Returns what was done: created, resumed, paused, unchanged."""
    handle = client.get_schedule_handle(SWEEP_SCHEDULE_ID)
    try:
        paused = (await handle.describe()).schedule.state.paused
    except RPCError as exc:
        if exc.status != RPCStatusCode.NOT_FOUND:
            raise
        paused = None  # no schedule yet
    if not settings.sweep_enabled:
        if paused is False:
            await handle.pause(note="ROUNDTABLE_SWEEP_ENABLED=false on a worker")
            return "paused"
        return "unchanged"
    if paused is None:
        try:
            await client.create_schedule(SWEEP_SCHEDULE_ID, _sweep_schedule(settings))
            return "created"
        except ScheduleAlreadyRunningError:
            return "unchanged"  # another worker made it first
    if paused:
        await handle.unpause(note="ROUNDTABLE_SWEEP_ENABLED=true on a worker")
        return "resumed"
    return "unchanged"


def _sweep_schedule(settings: Settings) -> Schedule:
    return Schedule(
        action=ScheduleActionStartWorkflow(
            SweepWorkflow.run, id="roundtable-sweep-run", task_queue=settings.task_queue
        ),
        spec=ScheduleSpec(
            intervals=[
                ScheduleIntervalSpec(every=timedelta(seconds=settings.sweep_interval_seconds))
            ]
        ),
        policy=SchedulePolicy(overlap=ScheduleOverlapPolicy.SKIP),
    )


def tuning(settings: Settings) -> dict[str, Any]:
    """The worker's concurrency, cache and timing settings, as temporalio's
    Worker takes them; a setting left unset keeps the SDK's default."""
    chosen = {
        "max_concurrent_activities": settings.worker_max_concurrent_activities,
        "max_concurrent_local_activities": settings.worker_max_concurrent_local_activities,
        "max_concurrent_workflow_tasks": settings.worker_max_concurrent_workflow_tasks,
        "max_cached_workflows": settings.worker_max_cached_workflows,
    }
    options: dict[str, Any] = {k: v for k, v in chosen.items() if v is not None}
    options["sticky_queue_schedule_to_start_timeout"] = timedelta(
        seconds=settings.worker_sticky_queue_timeout_seconds
    )
    options["graceful_shutdown_timeout"] = timedelta(seconds=settings.shutdown_grace_seconds)
    return options


def set_aside_what_lives_for_good() -> None:
    """Leave out of every later collection what the process holds before its
    first run (modules, classes, settings, pools, MCP servers' sessions: some
    200,000 objects), so each full collection walks half as many
    (bench/README, "The collector, measured from inside the worker"). Only
    here, once, before any worker polls: an object frozen is never
    collected, and a run in flight frozen would be its garbage kept for good."""
    if gc.get_freeze_count() == 0:  # a process that runs a worker twice (tests): once
        gc.collect()  # what is garbage already is freed, not kept
        gc.freeze()


async def run_worker(settings: Settings | None = None, ready: asyncio.Event | None = None) -> None:
    settings = settings or load_settings()
    if (thresholds := settings.gc_thresholds()) is not None:
        gc.set_threshold(*thresholds)  # for the whole process: collection is per process
    runtime = None
    if settings.worker_metrics_address:
        runtime = metrics_runtime(settings.worker_metrics_address)
        log.info("serving metrics at http://%s/metrics", settings.worker_metrics_address)
    tracing = start_tracing("roundtable-worker")
    client = await connect(settings, runtime=runtime, tracing=tracing)
    metrics = Metrics(runtime.metric_meter if runtime is not None else None)
    role = settings.worker_role
    async with worker_parts(settings) as parts, contextlib.AsyncExitStack() as running:
        if role == "tools":
            queues = tool_queues(settings, parts.registry)
        else:
            log.info("sweep schedule: %s", await ensure_sweep_schedule(client, settings))
            queues = {settings.task_queue: sorted(parts.registry.tools)}
        set_aside_what_lives_for_good()
        workers: list[Worker] = []
        for queue, tools in queues.items():
            worker = build_worker(
                client,
                queue,
                parts.store,
                parts.registry,
                WebhookConfig.from_settings(settings),
                Authority.from_settings(settings),
                metrics,
                role=role,
                **tuning(settings),
            )
            workers.append(await running.enter_async_context(worker))
            if role == "tools":  # runs learn from the catalog where to send these
                specs = [
                    parts.registry.tools[name].spec().model_dump(mode="json") for name in tools
                ]
                await parts.store.publish_tools(specs, queue, client.identity)
            log.info(
                "%s worker polling %s on %s%s",
                role,
                queue,
                settings.temporal_address,
                f" for {', '.join(tools)}" if role == "tools" else "",
            )
        # Stopped all at once (LIFO: before each one's own exit): each gets
        # the whole grace period for its writes, not a share of it.
        running.push_async_callback(
            lambda: asyncio.gather(*(w.shutdown() for w in workers), return_exceptions=True)
        )
        # The gauges are recounted only where they are served.
        every = settings.metrics_refresh_seconds if runtime is not None else None
        async with recounting(parts.store, metrics, every):
            if ready is not None:
                ready.set()
            await asyncio.Event().wait()  # until cancelled (Ctrl-C)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    asyncio.run(run_worker())
