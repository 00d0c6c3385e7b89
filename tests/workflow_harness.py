"""A real Temporal time-skipping server, a real worker and a real SQLite store."""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import temporalio.api.enums.v1
from temporalio.client import (
    Client,
    Interceptor,
    OutboundInterceptor,
    StartWorkflowInput,
    WorkflowHandle,
    WorkflowHistory,
)
from temporalio.converter import DataConverter
from temporalio.runtime import Runtime
from temporalio.service import RPCError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from roundtable.config import PoolSizing
from roundtable.models import RunInput, RunState, WorkflowArgs
from roundtable.permissions import Authority
from roundtable.store import Store, open_store
from roundtable.telemetry.metrics import Metrics
from roundtable.temporal import data_converter, register_search_attributes
from roundtable.tools.registry import ToolRegistry
from roundtable.tools.tickets import TicketSystem, register_ticket_tools
from roundtable.workflow_runner import strict_runner
from tests.replaying import replay_failure
from tests.temporal_servers import start_dev_server, start_test_server
from worker import build_worker
from workflows import search_attributes
from workflows.roundtable import RoundtableWorkflow

# Workflow tests start runs straight through Temporal with whatever policy
# they test; the rules on who may ask for what have tests of their own.
TRUSTING = Authority(
    ceilings={role: "auto_approve_up_to:R3" for role in ("user", "service", "operator")},
    approvers="owner",
    operator_risk="none",
    allowed_models=frozenset({"*"}),
)


@dataclass
class Harness:
    env: WorkflowEnvironment
    client: Client
    store: Store
    tickets: TicketSystem
    registry: ToolRegistry
    task_queue: str
    make_worker: Callable[[Client], Worker]
    worker: Worker
    handles: list[WorkflowHandle] = field(default_factory=list)
    # Executions a test had written by other code on purpose (a stall it
    # then recovers): their histories are not expected to replay.
    foreign: set[str] = field(default_factory=set)
    _restarted: list[asyncio.Task] = field(default_factory=list)

    async def stop_worker(self) -> None:
        """No worker polls until start_worker: messages sent meanwhile wait
        in the history and arrive together, in one workflow task."""
        await self.worker.shutdown()

    async def start_worker(self, client: Client | None = None) -> None:
        """A new worker, connected through ``client`` (e.g. other payload keys)."""
        self.worker = self.make_worker(client or self.client)
        self._restarted.append(asyncio.create_task(self.worker.run()))

    async def _stop_restarted(self) -> None:
        await self.worker.shutdown()
        for task in self._restarted:
            await task

    async def start(self, task_timeout: timedelta | None = None, **fields: Any) -> WorkflowHandle:
        """A run of ``fields`` (RunInput's); ``task_timeout``: its workflow
        tasks' (Temporal's default, 10 s, when None)."""
        run_id = fields.pop("run_id", None) or f"run-{uuid.uuid4().hex[:12]}"
        request = RunInput(run_id=run_id, **fields)
        handle = await self.client.start_workflow(
            RoundtableWorkflow.run,
            WorkflowArgs(request=request),
            id=run_id,
            task_queue=self.task_queue,
            static_summary=f"test: {request.task_text[:60]}",
            task_timeout=task_timeout,
        )
        self.handles.append(handle)
        return handle

    async def state(self, handle: WorkflowHandle) -> RunState:
        return await handle.query(RoundtableWorkflow.state)

    async def result(self, handle: WorkflowHandle, within: float = 120) -> Any:
        """``handle.result()``, or, past ``within`` seconds, a failure that
        tells where the run stood: its state, its actions in the store and
        its history's last events. A bare result() that never comes holds
        the test to pytest-timeout, and its teardown beyond (stop 23's CI)."""
        try:
            return await asyncio.wait_for(handle.result(), within)
        except TimeoutError:
            raise AssertionError(await self.story(handle)) from None

    async def story(self, handle: WorkflowHandle) -> str:
        lines = [f"run {handle.id} gave no result"]
        try:
            state = await self.state(handle)
            lines.append(
                f"state: {state.status}; blocked {state.blocked_writes}; "
                f"unknown {state.unknown_actions}; pending {state.pending_approvals}"
            )
        except Exception as exc:  # the story must not hide the failure
            lines.append(f"state: not readable ({exc!r})")
        for action in await self.store.list_actions(handle.id):
            lines.append(f"action {action['id']} {action['tool_name']} {action['status']}")
        events = [event async for event in handle.fetch_history_events()]
        for event in events[-25:]:
            kind = temporalio.api.enums.v1.EventType.Name(event.event_type)
            lines.append(f"  {event.event_id} {event.event_time.ToDatetime():%H:%M:%S.%f} {kind}")
        return "\n".join(lines)

    async def wait_for(
        self, handle: WorkflowHandle, check: Callable[[RunState], bool], within: float = 20
    ) -> RunState:
        """Poll the query without awaiting the result, so time does not skip."""
        deadline = asyncio.get_running_loop().time() + within
        while True:
            state = await self.state(handle)
            if check(state):
                return state
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"condition not reached; state is {state.status}")
            await asyncio.sleep(0.05)


@asynccontextmanager
async def harness(
    tmp_path: Path,
    *,
    write_delay: float = 0.0,
    customize: Callable[[ToolRegistry, TicketSystem], None] | None = None,
    worker_factory: Callable[..., Worker] | None = None,
    restartable: bool = False,
    dev_server: bool = False,
    converter: DataConverter | None = None,
    authority: Authority = TRUSTING,
    database_url: str | None = None,
    dev_server_args: list[str] | None = None,
    runtime: Runtime | None = None,
    metrics: Metrics | None = None,
    interceptors: Sequence[Interceptor] = (),
    pool: PoolSizing | None = None,
) -> AsyncIterator[Harness]:
    """``restartable``: the test stops and starts workers (stop_worker,
    start_worker). Workers then keep no sticky cache: the time-skipping server
    never hands a stopped worker's sticky tasks to another worker.
    ``dev_server``: the real Temporal dev server instead (real time, real
    sticky queues, schedules); ``converter``: the harness client's own.
    ``authority``: the worker's rules; by default it trusts whatever a test
    starts (tests of the rules themselves pass their own).
    ``database_url``: the store's database (default SQLite in ``tmp_path``);
    the demo ticket system stays on SQLite. ``dev_server_args``: more
    arguments for the dev server (dynamic config, say). ``runtime``: the
    time-skipping server's client's (metrics); ``metrics``: the worker's;
    ``interceptors``: the client's, which its workers inherit (tracing);
    ``pool``: the store's PostgreSQL pool sizes."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'roundtable.db'}"
    if dev_server:
        env = await start_dev_server(
            search_attributes=list(search_attributes.ALL),
            data_converter=converter or data_converter(),
            dev_server_extra_args=dev_server_args or [],
        )
    else:
        env = await start_test_server(data_converter=converter or data_converter(), runtime=runtime)
    # Always through an interceptor of the harness's own, which notes what
    # the test starts (its workers inherit the client's interceptors).
    started = _StartedWorkflows()
    config = env.client.config()
    # (after the environment's own: time-skipping's unlocks time in result())
    config["interceptors"] = [*config["interceptors"], *interceptors, started]
    client = Client(**config)
    try:
        if not dev_server:
            await register_search_attributes(env.client)
        async with open_store(database_url or url, pool=pool) as store:
            tickets = await TicketSystem.open(url, write_delay_seconds=write_delay)
            registry = ToolRegistry()
            register_ticket_tools(registry, tickets)
            if customize is not None:
                customize(registry, tickets)
            queue = f"rt-test-{uuid.uuid4().hex[:8]}"
            factory = worker_factory or build_worker

            options: dict[str, Any] = {"authority": authority}
            if metrics is not None:
                options["metrics"] = metrics
            if restartable and not dev_server:
                options["max_cached_workflows"] = 0

            def make(client: Client) -> Worker:
                return factory(client, queue, store, registry, **options)

            first = make(client)
            try:
                async with first:
                    made = Harness(env, client, store, tickets, registry, queue, make, first)
                    try:
                        yield made
                        await _check_histories(made, started.handles)
                    finally:
                        await made._stop_restarted()
            finally:
                await tickets.close()
    finally:
        await env.shutdown()


def ticket_call(name: str, ticket: str = "T-1", **args: Any) -> dict[str, Any]:
    base = {"tenant_id": "acme", "ticket_id": ticket}
    if name == "ticket_update":
        base["fields"] = args.pop("fields", {"priority": "high"})
    if name == "ticket_comment":
        base["body"] = args.pop("body", "looking into it")
    return {"name": name, "args": {**base, **args}}


def script(*turns: tuple[str, int, list[dict[str, Any]]], final: str = "done") -> dict:
    return {
        "turns": [
            {
                "seat": seat,
                "round": rnd,
                "text": f"{seat} speaks in round {rnd}",
                "tool_calls": calls,
            }
            for seat, rnd, calls in turns
        ],
        "final": final,
    }


class _StartedWorkflows(Interceptor):
    """Notes every workflow the harness's client starts (runs, reconciliation
    workflows, sweeps), so that each one's history is checked at the end."""

    def __init__(self) -> None:
        self.handles: list[WorkflowHandle] = []

    def intercept_client(self, next: OutboundInterceptor) -> OutboundInterceptor:
        return _NoteStarts(next, self.handles)


class _NoteStarts(OutboundInterceptor):
    def __init__(self, next: OutboundInterceptor, handles: list[WorkflowHandle]) -> None:
        super().__init__(next)
        self._handles = handles

    async def start_workflow(self, input: StartWorkflowInput) -> WorkflowHandle:
        handle = await super().start_workflow(input)
        self._handles.append(handle)
        return handle


async def _check_histories(made: Harness, started: list[WorkflowHandle]) -> None:
    """Every workflow the test started replays in the SDK's strict sandbox:
    the worker runs workflow code outside it (roundtable/workflow_runner.py),
    so the sandbox's restrictions watch each path the tests take here, and a
    forbidden call (a clock, I/O, randomness) on any of them fails its test.
    With ROUNDTABLE_RECORD_HISTORIES=DIR, each history is also kept for the
    replay test (tests/test_replay.py)."""
    target = os.environ.get("ROUNDTABLE_RECORD_HISTORIES")
    test_name = os.environ.get("PYTEST_CURRENT_TEST", "run").split("::")[-1].split(" ")[0]
    seen: set[tuple[str, str | None]] = set()
    # The run each start began (a later start of the same id is its own),
    # then each run it continued as.
    todo = [(started_as.id, started_as.result_run_id) for started_as in [*made.handles, *started]]
    # And each workflow's latest execution: a reset (a recovery) starts one
    # that no start and no continue-as-new names.
    for workflow_id in sorted({started_as.id for started_as in [*made.handles, *started]}):
        with contextlib.suppress(RPCError):
            latest = await made.client.get_workflow_handle(workflow_id).describe()
            todo.append((workflow_id, latest.run_id))
    while todo:
        run = todo.pop(0)
        if run in seen or run[1] in made.foreign:
            continue
        seen.add(run)
        history = await made.client.get_workflow_handle(run[0], run_id=run[1]).fetch_history()
        last = history.events[-1] if history.events else None
        if last is not None and last.HasField(
            "workflow_execution_continued_as_new_event_attributes"
        ):
            continued = last.workflow_execution_continued_as_new_event_attributes
            todo.append((run[0], continued.new_execution_run_id))
        # The last worker's keys read every payload (the key-rotation tests).
        await replays_strictly(history, made.worker.client.data_converter)
        if target:
            suffix = f"-{len(seen) - 1}" if len(seen) > 1 else ""
            text = history.to_json()
            await asyncio.to_thread(_save, Path(target), f"{test_name}{suffix}.json", text)


async def replays_strictly(history: WorkflowHistory, converter: DataConverter) -> None:
    failure = await replay_failure(history, strict_runner(), converter)
    assert failure is None, (
        f"{history.workflow_id} does not replay in the strict sandbox: {failure!r}"
    )


def _save(directory: Path, name: str, text: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / name).write_text(text)


def as_operator(message: Any) -> Any:
    """A decision or reconciliation as the API or CLI sends it for an operator:
    with the server's attestation (tests hold the action secret)."""
    from datetime import UTC, datetime

    from roundtable.permissions import Decider, attest

    return attest(message, Decider(user_id=message.decided_by, role="operator"), datetime.now(UTC))


def shorten_bookkeeping(monkeypatch: Any, seconds: float = 10) -> timedelta:
    """Give the workflows' store calls (``BOOKKEEPING``, 30 s) ``seconds``
    of start-to-close instead, for a test that waits one out in real time
    (what times out is the same; 10 s is still far more than a store call
    takes on a loaded machine, so nothing else in the test times out).
    Every ``workflows`` module that took the name is patched, so a module
    added later is not left on 30 s (the test would then wait it out and
    time out instead of failing on what it checks). Replay does not compare
    timeouts, so the runs' histories replay as any other."""
    import sys

    from workflows import timeouts

    original, shorter = timeouts.BOOKKEEPING, timedelta(seconds=seconds)
    patched = []
    for name, module in list(sys.modules.items()):
        if name.startswith("workflows.") and getattr(module, "BOOKKEEPING", None) is original:
            monkeypatch.setattr(module, "BOOKKEEPING", shorter)
            patched.append(name)
    for needed in ("workflows.roundtable", "workflows.write_path", "workflows.status"):
        assert needed in patched, f"{needed} no longer takes BOOKKEEPING: {patched}"
    return shorter
