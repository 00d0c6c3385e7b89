"""Worker roles when things go wrong: tool workers dying mid-call, missing,
moved or misconfigured; runs ending while calls wait for one; decisions
waiting for one. Written by an adversarial review of the first version (each
failed on it). Real time-skipping server (the real dev server where the
time-skipping one hands a retry to a worker that is shutting down), real
workers, real SQLite store and demo ticket system."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from pydantic import BaseModel
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowFailureError, WorkflowUpdateFailedError
from temporalio.worker import ActivityInboundInterceptor, ExecuteActivityInput, Interceptor

from roundtable import operations
from roundtable.config import Settings
from roundtable.models import Decision
from roundtable.names import DECIDE_UPDATE, DECISION_SIGNAL
from roundtable.permissions import MAX_ATTESTATION_AGE, Decider, attest
from roundtable.security import Target
from roundtable.store import ConflictError, InvalidInputError
from roundtable.tools.registry import ToolContext, ToolDefinition, ToolRegistry
from roundtable.tools.tickets import TicketUpdateArgs
from tests.test_edits import decide
from tests.test_worker_roles import (
    AUTO,
    AUTO_R1,
    TOOLS_QUEUE,
    WAIT,
    lost_before_acting,
    publish,
    tool_worker,
    unknown_routed_write,
    unknown_write,
    workflows_only,
)
from tests.test_workflow_execution import reconcile, wrap_tool
from tests.workflow_harness import (
    TRUSTING,
    Harness,
    harness,
    script,
    shorten_bookkeeping,
    ticket_call,
)
from worker import build_worker, tool_queues


async def _ended_within(h: Harness, handle: Any, seconds: float) -> bool:
    """Whether the workflow closed within ``seconds`` of real time."""
    with h.env.auto_time_skipping_disabled():
        try:
            await asyncio.wait_for(handle.result(), timeout=seconds)
        except WorkflowFailureError:
            return True
        except TimeoutError:
            return False
    return True


# --------------------------------------------------------------- 1. liveness


async def test_a_run_cancelled_while_its_write_waits_for_a_tool_worker_ends(tmp_path) -> None:
    """A write's intercept waits for a tool worker (until_served loops for
    ever); the run is cancelled. _end_early waits for every tool-call task,
    and the intercept loop never looks at the run ending (the read's loop
    does): the cancelled run never ends while no tool worker comes."""
    calls = [ticket_call("ticket_comment", "T-1")]
    async with harness(tmp_path, worker_factory=workflows_only) as h:
        await publish(h, "rt-review-nobody")  # its tool worker is gone
        handle = await h.start(
            task_text="t", script=script(("seat-1", 1, calls)), write_policy=AUTO, **WAIT
        )
        await h.wait_for(handle, lambda s: bool(s.unserved_calls))
        await handle.cancel()
        ended = await _ended_within(h, handle, 20)
        run = await h.store.get_run(handle.id)
        if not ended:
            await handle.terminate(reason="review test cleanup")
    assert ended, "the cancelled run is still waiting for a tool worker to intercept its write"
    assert run["status"] == "cancelled"


# --------------------------------------------------------------- 2. a read run twice


class _Ref(BaseModel):
    record_id: str


def untrusted_read(calls: list[str], entered: asyncio.Event):  # type: ignore[no-untyped-def]
    """An MCP-like read whose read-only hint is not trusted (retry_safe=False):
    it must run at most once. Its first call hangs (the worker will die)."""

    def customize(registry: ToolRegistry, _tickets: Any) -> None:
        async def handler(args: _Ref, ctx: ToolContext) -> dict:
            calls.append(args.record_id)
            if len(calls) == 1:
                entered.set()
                await asyncio.Event().wait()  # the worker dies meanwhile
            return {"record_id": args.record_id}

        registry.register(
            ToolDefinition(
                name="records_lookup",
                description="Look a record up (its server says read-only).",
                side_effect="read",
                risk_level="R0",
                handler=handler,
                args_model=_Ref,
                retry_safe=False,
            )
        )

    return customize


async def test_an_untrusted_read_is_not_run_again_after_its_worker_died(tmp_path) -> None:
    """run_read_tool keeps Temporal's default retry policy. Its first attempt
    reached the tool, then the tool worker died: Temporal retries (attempt 2).
    Without routing, attempt 2 runs on a worker and answers not_retried. With
    routing, attempt 2 waits for a tool worker, times out schedule-to-start,
    and until_served takes that for "never started" and schedules a brand-new
    activity (attempt 1 again): the untrusted read runs a second time."""
    calls: list[str] = []
    entered = asyncio.Event()
    read = {"name": "records_lookup", "args": {"record_id": "r-1"}}
    # The real dev server: the time-skipping one hands the retry to the
    # worker that is shutting down, which the real server does not.
    async with harness(
        tmp_path,
        worker_factory=workflows_only,
        customize=untrusted_read(calls, entered),
        dev_server=True,
    ) as h:
        await publish(h)
        first = tool_worker(h, graceful_shutdown_timeout=timedelta(0))
        running = asyncio.create_task(first.run())
        handle = await h.start(task_text="t", script=script(("seat-1", 1, [read])), **WAIT)
        await asyncio.wait_for(entered.wait(), 20)
        await first.shutdown()  # the tool worker dies mid-call
        await running
        # The retry finds no tool worker; the run says it waits for one.
        await h.wait_for(handle, lambda s: bool(s.unserved_calls), within=30)
        async with tool_worker(h):
            assert (await handle.result()).status == "completed"
    assert calls == ["r-1"], f"the untrusted read ran {len(calls)} times"


# --------------------------------------------------------------- 3. fence skipped


async def test_a_tool_worker_lacking_the_tool_never_records_failed_unfenced(tmp_path) -> None:
    """Tool workers on the shared tool queue need not all have the same tools
    (MCP configs differ by host, a server lists other tools after an upgrade);
    the catalog keeps one queue per tool, the last publisher's. A `failed`
    reconciliation that lands on a tool worker lacking the tool skips the
    fence (tools_here is True on every tools worker), so the frozen attempt's
    late write lands after the operator's "failed"."""
    async with harness(tmp_path, worker_factory=workflows_only) as h:
        original = h.registry.tools["ticket_update"].handler
        wrap_tool(h.registry, "ticket_update", lost_before_acting)
        await publish(h)
        async with tool_worker(h):
            handle, action_id = await unknown_write(h)
        # Another tool worker on the same queue, without the ticket tools.
        other = ToolRegistry(
            tools={k: v for k, v in h.registry.tools.items() if not k.startswith("ticket_")}
        )
        lacking = build_worker(
            h.client, TOOLS_QUEUE, h.store, other, authority=TRUSTING, role="tools"
        )
        async with lacking:
            try:
                outcome = await reconcile(handle, action_id, "failed")
            except Exception as exc:  # refused: what a workflows worker does
                outcome = f"refused: {exc}"
            await handle.terminate(reason="review test cleanup")
        action = await h.store.get_action(action_id)
        # The attempt frozen past its lease writes late, with its own token.
        late: Any = "not tried"
        if action["status"] == "failed":
            try:
                late = await original(
                    TicketUpdateArgs(tenant_id="acme", ticket_id="T-1", fields={"p": "late"}),
                    ToolContext(
                        run_id=handle.id,
                        seat="seat-1",
                        action_id=action_id,
                        idempotency_key=action["idempotency_key"],
                        fencing_token=action["fencing_token"],
                    ),
                )
            except Exception as exc:  # refused as stale: what the fence is for
                late = exc
        log = await h.tickets.write_log()
    applied_late = [w for w in log if w["outcome"] == "applied"]
    assert not applied_late, (
        f"reconciled {outcome!r} without a fence (result {action['result']}); "
        f"then the late write landed: {applied_late} ({late!r})"
    )


# --------------------------------------------------------------- 4. the main queue


def test_a_tool_worker_does_not_share_the_main_task_queue_by_default() -> None:
    """ROUNDTABLE_TOOL_TASK_QUEUE defaults to ROUNDTABLE_TASK_QUEUE: a
    `--role tools` worker started without it polls the workflows workers'
    queue and publishes it in the catalog. Every routed call may then be taken
    by a workflows worker (see the next test). It should be refused at start
    (or default to a queue of its own)."""
    registry = ToolRegistry()
    registry.tools = {"ticket_update": None}  # type: ignore[dict-item]
    settings = Settings(worker_role="tools", task_queue="roundtable")
    try:
        queues = tool_queues(settings, registry)
    except ValueError:
        return  # refused: fine
    assert settings.task_queue not in queues, queues


async def test_a_write_routed_to_the_main_queue_is_not_refused_by_a_workflows_worker(
    tmp_path,
) -> None:
    """The catalog names the main task queue (a tool worker started with the
    default tool queue, restarting just now). The routed intercept is taken by
    the workflows worker, whose registry is empty: the write is refused for
    good as invalid_arguments ("not available on this worker") instead of
    waiting for a tool worker. (A run_read_tool or execute_write taken there
    fails as not registered and is retried with no word in the details.)"""
    calls = [ticket_call("ticket_comment", "T-1")]
    async with harness(tmp_path, worker_factory=workflows_only) as h:
        await publish(h, h.task_queue)
        handle = await h.start(
            task_text="t", script=script(("seat-1", 1, calls)), write_policy=AUTO, **WAIT
        )
        try:  # refused at once (the defect), or still waiting for a tool worker
            state = await h.wait_for(handle, lambda s: s.status == "completed", within=10)
        except AssertionError:
            state = await h.state(handle)
            await handle.terminate(reason="review test cleanup")
    said = repr(state.threads.get("seat-1"))
    assert "not available on this worker" not in said, said


# --------------------------------------------------------------- 5. stale route


async def test_an_unknown_is_reconcilable_once_its_tool_moved_to_another_queue(tmp_path) -> None:
    """The run pinned ticket_update to one queue; the tool workers now serve
    it on another (ROUNDTABLE_TOOL_TASK_QUEUE changed, or --tools added), and
    the catalog says so. operations.reconcile (API, CLI) goes through the open
    workflow, whose pinned route has no worker: NoToolWorker (a conflict), and
    no fallback to the reconciliation workflow that reads the catalog. The
    unknown, and with it its target for every run, stays blocked until the
    run is terminated or a worker polls the old queue again."""
    async with harness(tmp_path, worker_factory=workflows_only) as h:
        handle, action_id = await unknown_routed_write(h)
        await publish(h, "rt-review-moved")
        async with tool_worker(h, "rt-review-moved"):
            with h.env.auto_time_skipping_disabled():
                try:
                    done = await operations.reconcile(
                        h.client, h.store, action_id, "failed", "op-1", "checked", h.task_queue
                    )
                except ConflictError as exc:
                    done = {"status": f"refused: {exc}"}
            await handle.terminate(reason="review test cleanup")
    assert done["status"] == "failed", done


# --------------------------------------------------------------- 6. --tools " , "


def test_a_tools_list_of_nothing_is_not_every_tool() -> None:
    """`--tools ","` (or a templated ROUNDTABLE_WORKER_TOOLS that came out
    empty of names) limits the worker to nothing, yet it serves every tool on
    the shared queue: the limit silently widens to all."""
    registry = ToolRegistry()
    registry.tools = {"ticket_get": None, "ticket_update": None}  # type: ignore[dict-item]
    with pytest.raises(ValueError):
        tool_queues(Settings(tool_task_queue="tq", worker_tools=" , "), registry)


# --------------------------------------------------------------- 7. one bad catalog row


async def test_one_unreadable_catalog_row_does_not_stop_every_run(tmp_path) -> None:
    """ensure_run validates every catalog row (ToolSpec forbids unknown
    fields) before it builds the snapshot, outside any typed error: a row
    published by a newer tool worker (a spec field this worker does not know)
    makes every new run's ensure_run fail and retry for ever, even a run that
    names only other tools."""
    calls = [ticket_call("ticket_get", "T-1")]
    async with harness(tmp_path, worker_factory=workflows_only) as h:
        await publish(h)
        future = {**h.registry.tools["ticket_get"].spec().model_dump(mode="json")}
        future.update(name="records_search", idempotent_hint=True)  # a field from later code
        await h.store.publish_tools([future], TOOLS_QUEUE, "a-newer-tool-worker")
        async with tool_worker(h):
            handle = await h.start(
                task_text="t", script=script(("seat-1", 1, calls)), tools=["ticket_get"]
            )
            try:
                await h.wait_for(handle, lambda s: s.status == "completed", within=20)
                opened = True
            except AssertionError:
                opened = False
                await handle.terminate(reason="review test cleanup")
    assert opened, "the run never opened: ensure_run fails on a catalog row it does not need"


# --------------------------------------------------------------- 8. attestation outlived


async def test_a_decision_queued_past_its_attestation_keeps_the_tenant_check(tmp_path) -> None:
    """A routed decision waits in the tool queue for up to the run's
    tool_worker_wait_seconds (the API allows 3600) and is retried past that.
    An attestation is good for MAX_ATTESTATION_AGE (10 min); one that has
    aged in the queue reads as "nobody vouched" (role None, tenants None),
    and then decide_approval skips the tenant check altogether. A
    globex-only approver's approval of an acme write, refused when fresh,
    is recorded as approved once it waited long enough for a tool worker.
    (The wait of more than ten minutes is stood in for by an attestation
    made 10 min - 3 s before the decision is sent; the decision then waits
    8 s for the tool worker.)"""
    calls = [ticket_call("ticket_update", "T-1", fields={"owner": "a"})]  # tenant acme
    async with harness(tmp_path, worker_factory=workflows_only) as h:
        await publish(h)
        async with tool_worker(h):
            handle = await h.start(
                task_text="t",
                script=script(("seat-1", 1, calls)),
                write_policy=AUTO_R1,
                tool_worker_wait_seconds=900,
            )
            state = await h.wait_for(handle, lambda s: bool(s.pending_approvals))
        (approval_id,) = state.pending_approvals
        gina = Decider(user_id="gina", role="user", tenants=("globex",))
        decision = attest(
            Decision(approval_id=approval_id, decision="approved", decided_by="gina"),
            gina,
            datetime.now(UTC) - MAX_ATTESTATION_AGE + timedelta(seconds=3),
        )
        with h.env.auto_time_skipping_disabled():
            update = asyncio.create_task(
                handle.execute_update(DECIDE_UPDATE, decision, result_type=str)
            )
            await asyncio.sleep(8)  # no tool worker: the decision waits in its queue
            async with tool_worker(h):
                try:
                    outcome: Any = await asyncio.wait_for(update, 30)
                except Exception as exc:
                    outcome = f"refused: {exc!r} {getattr(exc, 'cause', '')}"
                approval = await h.store.get_approval(approval_id)
            await handle.terminate(reason="review test cleanup")
    assert approval["status"] == "pending", (
        f"a globex-only approver's decision on an acme write was recorded: {outcome!r}, "
        f"decided by {approval.get('decided_by')!r}"
    )


# --------------------------------------------------------------- 10. "changes nothing"


class _DiesAfterDeciding:
    """The tool worker's store: the decision (or the edit) commits, then the
    worker dies before it can report it (stands in for a crash right after
    the commit)."""

    def __init__(self, store: Any, committed: asyncio.Event) -> None:
        self._store, self._committed = store, committed

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    async def decide_approval(self, *args: Any, **kwargs: Any) -> Any:
        await self._store.decide_approval(*args, **kwargs)
        await self._dies()

    async def approve_with_edits(self, *args: Any, **kwargs: Any) -> Any:
        await self._store.approve_with_edits(*args, **kwargs)
        await self._dies()

    async def _dies(self) -> None:
        self._committed.set()
        self.dead = True
        await asyncio.Event().wait()

    async def get_approval(self, *args: Any, **kwargs: Any) -> Any:
        """A dead worker does nothing more: the test's shutdown cancels its
        call, which a crash would not, and the refresh sent after a
        cancelled decision must not reach the run through it."""
        if getattr(self, "dead", False):
            raise RuntimeError("this worker is dead")
        return await self._store.get_approval(*args, **kwargs)


class _AnotherDecidesThenDies(_DiesAfterDeciding):
    """The tool worker's store: while op-1's decision is under way, op-2's
    plain approval (another request) commits first; then the worker dies
    before op-1's call is answered."""

    async def decide_approval(self, approval_id: str, *args: Any, **kwargs: Any) -> Any:
        await self._store.decide_approval(approval_id, "approved", "op-2", "op-2's reason")
        await self._dies()

    async def approve_with_edits(self, approval_id: str, *args: Any, **kwargs: Any) -> Any:
        await self.decide_approval(approval_id)


async def _routed_write_waiting(h: Harness) -> tuple[Any, str]:
    """A run whose one write (a ticket update, tools on the tool queue)
    waits for approval, started while a healthy tool worker served it."""
    calls = [ticket_call("ticket_update", "T-1", fields={"owner": "a"})]
    await publish(h)
    async with tool_worker(h):
        handle = await h.start(
            task_text="t", script=script(("seat-1", 1, calls)), write_policy=AUTO_R1, **WAIT
        )
        state = await h.wait_for(handle, lambda s: bool(s.pending_approvals))
    (approval_id,) = state.pending_approvals
    return handle, approval_id


class _AnotherEditsThenDies(_DiesAfterDeciding):
    """As _AnotherDecidesThenDies, op-2's approval moving the write to T-3."""

    async def decide_approval(self, approval_id: str, *args: Any, **kwargs: Any) -> Any:
        edited = {"tenant_id": "acme", "ticket_id": "T-3", "fields": {"owner": "c"}}
        target = Target(key="acme/T-3", scope=None, namespace_wide=False)  # the lease its own
        await self._store.approve_with_edits(approval_id, "op-2", None, None, edited, target)
        await self._dies()


async def _decided_on_a_dying_tool_worker(
    tmp_path: Any, dying_store: type[_DiesAfterDeciding], signal: bool = False, **fields: Any
) -> tuple[Any, dict[str, Any], list[dict[str, Any]], list[dict[str, Any]]]:
    """op-1 decides (``fields``: edits; by an update, or a ``signal``) a
    write routed to a tool worker whose store is ``dying_store``: something
    commits, then the worker dies. The routed decide_approval keeps the
    default retry policy: its next attempt finds no tool worker and times
    out schedule-to-start, so the run is left with the store's word alone.
    Returns what op-1 was told (None for a signal), the approval as the
    store has it, the ticket system's writes once a healthy tool worker has
    taken the run to its end, and what the seat was told of its write."""
    committed = asyncio.Event()
    async with harness(tmp_path, worker_factory=workflows_only, dev_server=True) as h:
        handle, approval_id = await _routed_write_waiting(h)
        dying = tool_worker(
            h, store=dying_store(h.store, committed), graceful_shutdown_timeout=timedelta(0)
        )
        running = asyncio.create_task(dying.run())
        if signal:
            sent = Decision(approval_id=approval_id, decision="approved", decided_by="op-1")
            await handle.signal(DECISION_SIGNAL, sent.model_copy(update=fields))
        else:
            update = asyncio.create_task(decide(handle, approval_id, **fields))
        await asyncio.wait_for(committed.wait(), 20)
        await dying.shutdown()
        await running
        outcome: Any = None
        if signal:  # the run has followed the store: its write waits for a tool worker
            await h.wait_for(handle, lambda s: not s.pending_approvals)
        else:
            try:
                outcome = await asyncio.wait_for(update, 30)
            except Exception as exc:
                outcome = f"refused: {getattr(exc, 'cause', exc)}"
        approval = await h.store.get_approval(approval_id)
        async with tool_worker(h):
            await asyncio.wait_for(handle.result(), 30)
        thread = (await h.state(handle)).threads["seat-1"]
        told = [json.loads(m.content) for m in thread if m.role == "tool"]
        return outcome, approval, await h.tickets.write_log(), told


async def test_a_decision_refused_with_no_tool_worker_changed_nothing(tmp_path) -> None:
    """README: a decision that needs a missing tool worker "is refused
    (NoToolWorker, HTTP 409) and changes nothing". Attempt 1 committed the
    decision and its worker died; attempt 2 found no tool worker. The
    approver was told nothing was done, the store said approved, and the
    run still waited on it. The decision is op-1's own: op-1 is told it
    stands."""
    outcome, approval, writes, _ = await _decided_on_a_dying_tool_worker(
        tmp_path, _DiesAfterDeciding
    )
    assert (outcome, approval["status"], approval["decided_by"]) == ("approved", "approved", "op-1")
    assert [w["outcome"] for w in writes] == ["applied"]


async def test_an_edit_recorded_before_its_tool_worker_died_is_op_1s_and_is_written(
    tmp_path,
) -> None:
    """As above, with edits: op-1 is told their edited approval stands, the
    write goes out with the edits, and the seat is told of them (the run
    used to answer from the approval's status alone, and the seat never
    learnt its write had been edited)."""
    edited = {"tenant_id": "acme", "ticket_id": "T-2", "fields": {"owner": "b"}}
    outcome, approval, writes, told = await _decided_on_a_dying_tool_worker(
        tmp_path, _DiesAfterDeciding, arguments=edited
    )
    assert (outcome, approval["decided_by"]) == ("approved", "op-1")
    assert [(w["ticket_id"], w["outcome"]) for w in writes] == [("T-2", "applied")]
    edit = {"field": "ticket_id", "before": "T-1", "after": "T-2"}
    assert edit in told[0]["result"].get("operator_edits", []), told


async def test_a_decision_whose_tool_worker_died_is_not_told_another_persons(
    tmp_path,
) -> None:
    """op-1's decision goes to a tool worker that dies; in the meantime
    op-2's approval (another request) is the one recorded. The run used to
    ask the store for the approval's status alone, and told op-1
    "approved" because approved is what op-1 asked: op-1 believed they had
    decided a write that op-2 decided, with op-2's reason on record. op-1
    is told the approval was decided by another request."""
    outcome, approval, writes, _ = await _decided_on_a_dying_tool_worker(
        tmp_path, _AnotherDecidesThenDies
    )
    assert (approval["status"], approval["decided_by"]) == ("approved", "op-2")
    assert str(outcome).startswith("refused") and "another request" in str(outcome), outcome
    assert [w["outcome"] for w in writes] == ["applied"]  # op-2's decision stands


async def test_an_edit_whose_tool_worker_died_is_not_told_another_persons_approval(
    tmp_path,
) -> None:
    """The same with op-1's edits: op-2's plain approval was recorded, so
    the write goes out with its original arguments. op-1 was told
    "approved", believing their edits were made; they are told the
    approval was decided by another request."""
    edited = {"tenant_id": "acme", "ticket_id": "T-2", "fields": {"owner": "b"}}
    outcome, approval, writes, told = await _decided_on_a_dying_tool_worker(
        tmp_path, _AnotherDecidesThenDies, arguments=edited
    )
    assert approval["decided_by"] == "op-2"
    assert str(outcome).startswith("refused") and "another request" in str(outcome), outcome
    assert "operator_edits" not in told[0]["result"], told
    assert [(w["ticket_id"], w["outcome"]) for w in writes] == [("T-1", "applied")]


# --------------------------------------------------------------- 11. an outage fails the run


async def test_a_tool_worker_outage_longer_than_the_approval_timeout_does_not_fail_the_run(
    tmp_path,
) -> None:
    """The approval's deadline is computed (workflow.now() +
    approval_timeout_seconds) before the intercept, and the intercept now
    waits for a tool worker for as long as it takes. After a tool-worker
    outage longer than the approval timeout (1 h by default) the intercept
    finally runs with a deadline in the past: the store refuses it
    ("expires_at must be in the future", InvalidInput, not retried) and the
    whole run FAILS. An ordinary outage fails every run that was about to ask
    for an approval."""
    calls = [ticket_call("ticket_update", "T-1", fields={"owner": "a"})]
    async with harness(tmp_path, worker_factory=workflows_only) as h:
        await publish(h)
        handle = await h.start(
            task_text="t",
            script=script(("seat-1", 1, calls)),
            write_policy=AUTO_R1,
            approval_timeout_seconds=5,
            **WAIT,
        )
        await h.wait_for(handle, lambda s: bool(s.unserved_calls))
        with h.env.auto_time_skipping_disabled():
            await asyncio.sleep(7)  # the outage outlasts the approval timeout
            async with tool_worker(h):
                for _ in range(100):  # until the write is recorded or the run ended
                    actions = await h.store.list_actions(handle.id)
                    run = await h.store.get_run(handle.id)
                    if actions or run["status"] in ("failed", "completed", "cancelled"):
                        break
                    await asyncio.sleep(0.1)
                if run["status"] not in ("failed", "completed", "cancelled"):
                    await handle.terminate(reason="review test cleanup")
    assert run["status"] != "failed", f"the run failed: {run['failure']}"
    assert actions and actions[0]["status"] == "waiting_approval", actions


async def test_an_edit_signalled_to_a_tool_worker_that_died_reaches_the_seat(tmp_path) -> None:
    """A signal answers nobody, but its edits stand: the write goes out with
    them, and the seat is told (the run used to take the approval's status
    alone, and never learnt of edits from it). From the review of 521197c."""
    edited = {"tenant_id": "acme", "ticket_id": "T-2", "fields": {"owner": "b"}}
    _, approval, writes, told = await _decided_on_a_dying_tool_worker(
        tmp_path, _DiesAfterDeciding, signal=True, arguments=edited
    )
    assert approval["status"] == "approved"  # by the signal's sender (the client's identity)
    assert [(w["ticket_id"], w["outcome"]) for w in writes] == [("T-2", "applied")]
    edit = {"field": "ticket_id", "before": "T-1", "after": "T-2"}
    assert edit in told[0]["result"].get("operator_edits", []), told


async def test_another_persons_edit_reaches_the_seat_when_a_decision_failed(tmp_path) -> None:
    """op-2 approved with edits while op-1's plain approval failed on a dying
    tool worker: op-1 is refused, and the seat is told of op-2's edits, which
    its write went out with."""
    outcome, approval, writes, told = await _decided_on_a_dying_tool_worker(
        tmp_path, _AnotherEditsThenDies
    )
    assert approval["decided_by"] == "op-2"
    assert str(outcome).startswith("refused") and "another request" in str(outcome), outcome
    assert [(w["ticket_id"], w["outcome"]) for w in writes] == [("T-3", "applied")]
    edit = {"field": "ticket_id", "before": "T-1", "after": "T-3"}
    assert edit in told[0]["result"].get("operator_edits", []), told


class _FrozenPastItsTimeout(_DiesAfterDeciding):
    """The tool worker's store: the edit waits (a worker frozen, the run lock
    slow) until released, well past the activity's start-to-close timeout,
    then commits and the worker goes on."""

    def __init__(self, store: Any, committed: asyncio.Event) -> None:
        super().__init__(store, committed)
        self.release = asyncio.Event()

    async def approve_with_edits(self, *args: Any, **kwargs: Any) -> Any:
        await self.release.wait()
        answer = await self._store.approve_with_edits(*args, **kwargs)
        self._committed.set()
        return answer


@pytest.mark.timeout(180)
async def test_an_edit_committed_after_its_run_gave_up_on_it_is_followed_and_told(
    tmp_path, monkeypatch
) -> None:
    """op-1's edit hangs on a tool worker past the activity's start-to-close
    timeout (30 s; 10 s here, shorten_bookkeeping); the run looks the
    request up, finds the approval pending and refuses op-1. Then
    the frozen call commits. Nothing told the run: it waited on to the
    approval's deadline (an hour) with the store saying approved, and when
    it learnt of the decision its seat was not told of the edits the write
    went out with. A decision on a tool worker answered this late now tells
    its run (a refresh), and every answer about a decided approval carries
    its edits. From the second review of 2026-12-07."""
    edited = {"tenant_id": "acme", "ticket_id": "T-2", "fields": {"owner": "b"}}
    committed = asyncio.Event()
    shorten_bookkeeping(monkeypatch)
    async with harness(tmp_path, worker_factory=workflows_only, dev_server=True) as h:
        handle, approval_id = await _routed_write_waiting(h)
        store = _FrozenPastItsTimeout(h.store, committed)
        frozen = tool_worker(h, store=store)
        async with frozen:
            with pytest.raises(WorkflowUpdateFailedError):  # the run gave up on it
                await asyncio.wait_for(decide(handle, approval_id, arguments=edited), 60)
            assert (await h.store.get_approval(approval_id))["status"] == "pending"
            store.release.set()
            await asyncio.wait_for(committed.wait(), 20)
            await h.wait_for(handle, lambda s: not s.pending_approvals, within=30)
        async with tool_worker(h):
            await asyncio.wait_for(handle.result(), 60)
        thread = (await h.state(handle)).threads["seat-1"]
        told = [json.loads(m.content) for m in thread if m.role == "tool"]
        writes = await h.tickets.write_log()
    assert [(w["ticket_id"], w["outcome"]) for w in writes] == [("T-2", "applied")]
    edit = {"field": "ticket_id", "before": "T-1", "after": "T-2"}
    assert edit in told[0]["result"].get("operator_edits", []), told


class _RefusesAfterAnotherDecided(_DiesAfterDeciding):
    """The tool worker's store: op-2's approval is recorded, then op-1's
    call is refused outright (as the tool worker refuses a stale word, a
    tenant it may not act for, edits its schema rejects)."""

    async def decide_approval(self, approval_id: str, *args: Any, **kwargs: Any) -> Any:
        await self._store.decide_approval(approval_id, "approved", "op-2")
        raise InvalidInputError("refused by the tool worker itself")


async def test_a_tool_workers_own_refusal_is_the_answer_not_a_lookup(tmp_path) -> None:
    """A refusal the activity made is its answer: the run does not go on to
    look the request up and answer something else (here it would have said
    "approved by another request"). From the second review of 2026-12-07."""
    async with harness(tmp_path, worker_factory=workflows_only, dev_server=True) as h:
        handle, approval_id = await _routed_write_waiting(h)
        store = _RefusesAfterAnotherDecided(h.store, asyncio.Event())
        refusing = tool_worker(h, store=store)
        async with refusing:
            with pytest.raises(WorkflowUpdateFailedError) as refused:
                await asyncio.wait_for(decide(handle, approval_id), 30)
        await handle.terminate(reason="test cleanup")
    said = str(refused.value.cause)
    assert "refused by the tool worker itself" in said and "another request" not in said, said


class _StartsLate(Interceptor):
    """The tool worker took the decision's task, then stalled before the
    activity's code began (an event loop blocked by another call, a paused
    process): the server's start-to-close clock ran, the activity's own
    did not start. From the third review of 2026-12-07."""

    def __init__(self, stall_seconds: float) -> None:
        self.stall_seconds = stall_seconds

    def intercept_activity(self, next: ActivityInboundInterceptor) -> ActivityInboundInterceptor:
        stall = self.stall_seconds

        class _Late(ActivityInboundInterceptor):
            async def execute_activity(self, input: ExecuteActivityInput) -> Any:
                if getattr(input.fn, "__name__", "") != "decide_approval":
                    return await super().execute_activity(input)
                # A paused process: the SDK's cancellation at the timeout
                # never reaches the call, which then runs as if nothing had
                # happened, so only the wall clock since the attempt started
                # can tell it is late. Swallowed for the whole call: one
                # that reached the store's call would tell the run by the
                # cancellation's path instead (a review saw it land there
                # in three runs of four).
                loop = asyncio.get_running_loop()
                resumes = loop.time() + stall
                while loop.time() < resumes:
                    try:
                        await asyncio.sleep(resumes - loop.time())
                    except asyncio.CancelledError:
                        asyncio.current_task().uncancel()  # type: ignore[union-attr]
                call = asyncio.ensure_future(super().execute_activity(input))
                while True:
                    try:
                        return await asyncio.shield(call)
                    except asyncio.CancelledError:
                        asyncio.current_task().uncancel()  # type: ignore[union-attr]

        return _Late(next)


@pytest.mark.timeout(180)
async def test_a_decision_that_began_late_and_committed_fast_tells_its_run(
    tmp_path, monkeypatch
) -> None:
    """The run gave up on op-1's decision (its start-to-close timeout
    passed with no answer, and its lookup found the approval pending); the
    stalled worker then ran it, and it committed at once. A refresh timed
    by the activity's own clock alone (past half its timeout) was never
    sent, and the run waited to its deadline with
    the store saying approved. The wall clock since the server started the
    attempt counts the stall too."""
    bookkeeping = shorten_bookkeeping(monkeypatch)
    async with harness(tmp_path, worker_factory=workflows_only, dev_server=True) as h:
        handle, approval_id = await _routed_write_waiting(h)
        late = tool_worker(h, interceptors=[_StartsLate(bookkeeping.total_seconds() + 5)])
        async with late:
            with pytest.raises(WorkflowUpdateFailedError):  # the run gave up on it
                await asyncio.wait_for(decide(handle, approval_id), 60)
            await h.wait_for(handle, lambda s: not s.pending_approvals, within=30)
            assert (await h.store.get_approval(approval_id))["status"] == "approved"
            # The run goes on to its write (on this same tool worker) and ends.
            await asyncio.wait_for(handle.result(), 60)


async def signals_in(handle: Any) -> list[Any]:
    """The signals in ``handle``'s history (a refresh is one)."""
    return [
        e
        async for e in handle.fetch_history_events()
        if e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED
    ]


async def test_a_decision_on_the_runs_own_worker_sends_no_refresh(tmp_path) -> None:
    """The refresh is for decisions on a tool worker only: a decision made
    by the run's own local activity (one worker doing everything, the
    approvals the benchmark times) adds no signal to the run's history."""
    calls = [ticket_call("ticket_update", "T-1", fields={"owner": "a"})]
    async with harness(tmp_path) as h:
        handle = await h.start(task_text="t", script=script(("seat-1", 1, calls)))
        state = await h.wait_for(handle, lambda s: bool(s.pending_approvals))
        (approval_id,) = state.pending_approvals
        assert await decide(handle, approval_id) == "approved"
        assert (await h.result(handle)).status == "completed"
        signals = await signals_in(handle)
    assert signals == []


async def test_a_decision_a_tool_worker_answers_in_time_sends_no_refresh(tmp_path) -> None:
    """A refresh wakes every wait of its run (other approvals look again,
    writes waiting for a target try again): a routed decision answered in
    time, or refused, sends none. From the fourth review of 2026-12-07."""
    async with harness(tmp_path, worker_factory=workflows_only, dev_server=True) as h:
        handle, approval_id = await _routed_write_waiting(h)
        async with tool_worker(h):
            with pytest.raises(WorkflowUpdateFailedError):  # the tool worker refuses it
                await decide(handle, approval_id, arguments_digest="0" * 64)
            assert await decide(handle, approval_id) == "approved"
            await asyncio.wait_for(handle.result(), 30)
        signals = await signals_in(handle)
    assert signals == []
