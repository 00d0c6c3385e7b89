"""A stalled run recovered (roundtable/recovery.py), end to end on the dev
server: its write still runs once, its approval is still decided once, by
the operator who decided it, and the reset is audited.

The stall is made as a bad deploy makes one: another build of the code takes
the run over and records a command this code does not make (a timer before
each signal is handled); this code, back, cannot replay the history, and
every workflow task of the run fails."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from temporalio import workflow
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowFailureError, WorkflowHandle
from temporalio.service import RPCError, RPCStatusCode
from temporalio.worker import (
    HandleSignalInput,
    Interceptor,
    Worker,
    WorkflowInboundInterceptor,
    WorkflowInterceptorClassInput,
)

from activities.sweep_activities import SweepActivities
from chaos.operator_bot import OperatorBot
from roundtable import recovery
from roundtable.agents.scripted import ScriptedModel
from roundtable.models import RunResult, TokenUsage
from roundtable.operations import TemporalUnavailableError, nudge
from roundtable.recovery import (
    MACHINES_REFUSED,
    NotRecoverableError,
    failed_by_divergence,
    recover_run,
)
from roundtable.states import STALLED_AFTER_ATTEMPTS
from roundtable.store import ConflictError
from tests.api_server import serve_api
from tests.test_workflow_approvals import decide, one_write
from tests.workflow_harness import (
    TRUSTING,
    Harness,
    harness,
    replays_strictly,
    script,
    ticket_call,
)
from worker import build_worker

WHY = {"note": "tasks fail: nondeterminism after the other build"}
FAILED = EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED
COMPLETED = EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED
TIMER_FIRED = EventType.EVENT_TYPE_TIMER_FIRED


class _SleepsFirst(WorkflowInboundInterceptor):
    async def handle_signal(self, input: HandleSignalInput) -> None:
        await workflow.sleep(0.01)
        await super().handle_signal(input)


class OtherBuild(Interceptor):
    """The other build's difference: a timer before each signal's handler."""

    def workflow_interceptor_class(
        self, input: WorkflowInterceptorClassInput
    ) -> type[WorkflowInboundInterceptor]:
        return _SleepsFirst


def other_build(h: Harness) -> Callable[[Client], Worker]:
    """Workers of the other build for the harness's queue and parts."""

    def make(client: Client) -> Worker:
        return build_worker(
            client,
            h.task_queue,
            h.store,
            h.registry,
            authority=TRUSTING,
            interceptors=[OtherBuild()],
        )

    return make


async def events(handle: WorkflowHandle) -> list[Any]:
    return [event async for event in handle.fetch_history_events()]


async def until(handle: WorkflowHandle, reached: Any, within: float = 30) -> list[Any]:
    for _ in range(int(within / 0.1)):
        seen = await events(handle)
        if reached(seen):
            return seen
        await asyncio.sleep(0.1)
    raise AssertionError(f"not reached; last events {[e.event_type for e in seen[-8:]]}")


def _timer_then_task(seen: list[Any]) -> bool:
    fired = [e.event_id for e in seen if e.event_type == TIMER_FIRED]
    return bool(fired) and any(e.event_type == COMPLETED and e.event_id > fired[-1] for e in seen)


def _failing(seen: list[Any]) -> bool:
    """A task failed as this code meets the other build's timer: where this
    code cancels a timer, core's machines refuse the event; where it makes
    another command, a nondeterminism (roundtable/recovery.py)."""
    return any(e.event_type == FAILED and failed_by_divergence(e) for e in seen)


async def until_stalled(handle: WorkflowHandle) -> None:
    """Until Temporal shows the run stalled: its task failed often enough."""
    await until(handle, _failing)
    for _ in range(300):
        described = await handle.describe()
        if described.raw_description.pending_workflow_task.attempt >= STALLED_AFTER_ATTEMPTS:
            return
        await asyncio.sleep(0.1)
    raise AssertionError("the run's workflow task did not keep failing")


async def stall(
    h: Harness, handle: WorkflowHandle, meanwhile: Callable[[], Awaitable[None]] | None = None
) -> int:
    """The run taken over by the other build (which does ``meanwhile``) and
    back; returns the event id of the other build's first task completion,
    the one to reset to."""
    before = len(await events(handle))
    await h.stop_worker()
    async with other_build(h)(h.client):
        await nudge(h.client, handle.id)
        seen = await until(handle, _timer_then_task)
        if meanwhile is not None:
            await meanwhile()
    h.foreign.add((await handle.describe()).run_id)  # its history is the other build's
    await h.start_worker()
    await nudge(h.client, handle.id)
    await until_stalled(handle)
    return next(e.event_id for e in seen[before:] if e.event_type == COMPLETED)


@pytest.mark.timeout(240)
async def test_a_stalled_run_is_recovered_and_its_write_runs_once(tmp_path) -> None:
    async with harness(tmp_path, dev_server=True) as h, serve_api(h) as api:
        handle = await h.start(task_text="t", script=one_write(), user_id="alice")
        state = await h.wait_for(handle, lambda s: bool(s.pending_approvals))
        (approval_id,) = state.pending_approvals
        diverged_at = await stall(h, handle)
        stalled_execution = (await handle.describe()).run_id

        # Over HTTP, by an operator only: the run's owner may not reset it.
        path = f"/v1/runs/{handle.id}/recover"
        refused = await api.http.post(path, headers=api.auth("alice"), json=WHY)
        assert (refused.status_code, refused.json()["code"]) == (403, "forbidden")
        assert (await handle.describe()).run_id == stalled_execution  # nothing reset
        answer = await api.http.post(path, headers=api.auth("ops"), json=WHY)
        assert answer.status_code == 200, answer.text
        done = answer.json()
        assert done["reset_to_event"] == diverged_at
        assert done["from_execution"] == stalled_execution
        assert done["execution"] != stalled_execution
        recovered = h.client.get_workflow_handle(handle.id, result_type=RunResult)
        assert (await recovered.describe()).run_id == done["execution"]

        # Recovered: it answers queries again, and a second recovery finds
        # nothing to do rather than resetting a healthy run.
        state = await h.wait_for(recovered, lambda s: approval_id in s.pending_approvals)
        again = await api.http.post(path, headers=api.auth("ops"), json=WHY)
        assert again.status_code == 409 and "not stalled" in again.json()["detail"]
        with pytest.raises(NotRecoverableError, match="tasks are not failing"):
            await recover_run(h.client, h.store, handle.id, "op-7", WHY["note"])

        assert await decide(recovered, approval_id, "approved", who="op-2") == "approved"
        assert (await h.result(recovered)).status == "completed"
        assert [w["outcome"] for w in await h.tickets.write_log()] == ["applied"]  # once
        (action,) = await h.store.list_actions(handle.id)
        assert action["status"] == "succeeded"
        (approval,) = await h.store.list_approvals(run_id=handle.id)
        assert (approval["status"], approval["decided_by"]) == ("approved", "op-2")

        recoveries = [
            (e["event_type"], e["payload"])
            for e in await h.store.list_events(handle.id)
            if e["event_type"].startswith("run.recover")
        ]
        assert recoveries == [
            (
                "run.recovery_begun",
                {
                    "by": "ops",
                    "note": WHY["note"],
                    "from_execution": stalled_execution,
                    "reset_to_event": diverged_at,
                },
            ),
            (
                "run.recovered",
                {
                    "claim": f"recovery:{stalled_execution}:0",
                    "from_execution": stalled_execution,
                    "execution": done["execution"],
                    "cancel_carried": False,
                },
            ),
        ]
        # The stalled execution ended with the reset's own reason (recovery
        # tells a reset whose answer was lost by it, roundtable/recovery.py _reset).
        stalled = h.client.get_workflow_handle(handle.id, run_id=stalled_execution)
        last = (await stalled.fetch_history()).events[-1]
        assert last.workflow_execution_terminated_event_attributes.reason == (
            f"roundtable recover (recovery:{stalled_execution}:0) by ops: "
            f"replay fails at event {diverged_at}"
        )
        # The recovered execution replays on this code, strictly.
        await replays_strictly(await recovered.fetch_history(), h.client.data_converter)

        ended = await api.http.post(path, headers=api.auth("ops"), json=WHY)
        assert ended.status_code == 409 and "has ended" in ended.json()["detail"]


@pytest.mark.timeout(240)
async def test_a_write_run_in_the_dropped_tail_is_not_run_again(tmp_path) -> None:
    """The reset drops what the other build recorded after the divergence: an
    approval decided and its write run there stay decided and run, once."""
    calls = [ticket_call("ticket_update", "T-1"), ticket_call("ticket_update", "T-2")]
    two = script(("seat-1", 1, calls))
    async with harness(tmp_path, dev_server=True) as h:
        handle = await h.start(task_text="t", script=two)
        state = await h.wait_for(handle, lambda s: len(s.pending_approvals) == 2)

        async def first_write_runs() -> None:
            first = next(iter(state.pending_approvals))
            assert await decide(handle, first, "approved", who="op-1") == "approved"
            for _ in range(300):
                if [w["outcome"] for w in await h.tickets.write_log()] == ["applied"]:
                    break
                await asyncio.sleep(0.1)
            else:
                raise AssertionError("the first write did not run under the other build")
            await until(handle, lambda seen: seen[-1].event_type == COMPLETED)

        await stall(h, handle, first_write_runs)
        await recover_run(h.client, h.store, handle.id, "op-7", WHY["note"])
        recovered = h.client.get_workflow_handle(handle.id, result_type=RunResult)
        pending = await h.wait_for(recovered, lambda s: len(s.pending_approvals) == 1)
        (second,) = pending.pending_approvals
        assert await decide(recovered, second, "approved", who="op-2") == "approved"
        assert (await h.result(recovered)).status == "completed"

        log = await h.tickets.write_log()
        assert sorted((w["ticket_id"], w["outcome"]) for w in log) == [
            ("T-1", "applied"),
            ("T-2", "applied"),
        ]
        approvals = await h.store.list_approvals(run_id=handle.id)
        assert sorted((a["status"], a["decided_by"]) for a in approvals) == [
            ("approved", "op-1"),
            ("approved", "op-2"),
        ]
        assert sorted(a["status"] for a in await h.store.list_actions(handle.id)) == [
            "succeeded",
            "succeeded",
        ]
        await replays_strictly(await recovered.fetch_history(), h.client.data_converter)


@pytest.mark.timeout(240)
async def test_the_sweep_calls_it_stalled_and_the_chaos_operator_recovers_it(tmp_path) -> None:
    """The way the chaos run meets the finding: the sweep marks the run
    stalled with the failure, the operator bot recovers it over HTTP, and the
    sweep, seeing its tasks succeed again, gives it back its status."""
    async with harness(tmp_path, dev_server=True) as h, serve_api(h) as api:
        handle = await h.start(task_text="t", script=one_write())
        state = await h.wait_for(handle, lambda s: bool(s.pending_approvals))
        (approval_id,) = state.pending_approvals
        await stall(h, handle)
        sweep = SweepActivities(h.store, h.client)
        for _ in range(300):  # until its task has failed often enough
            if (await sweep.check_runs())[1] == [handle.id]:
                break
            await asyncio.sleep(0.1)
        run = await h.store.get_run(handle.id)
        assert run["status"] == "stalled"
        assert MACHINES_REFUSED in run["failure"]["message"]

        bot = OperatorBot(
            str(api.http.base_url).rstrip("/"),
            api.tokens["ops"],
            h.tickets,
            random.Random(0),  # noqa: S311 - the bot's fates, not a secret
            tmp_path / "responses.jsonl",
        )
        async with bot.connected():
            await bot.recover_stalled(await bot.runs())
            await bot.recover_stalled(await bot.runs())  # not again at once
        assert dict(bot.counts) == {"recover:200": 1}

        recovered = h.client.get_workflow_handle(handle.id, result_type=RunResult)
        await h.wait_for(recovered, lambda s: approval_id in s.pending_approvals)
        for _ in range(300):
            await sweep.check_runs()
            if (await h.store.get_run(handle.id))["status"] == "waiting_input":
                break
            await asyncio.sleep(0.1)
        assert (await h.store.get_run(handle.id))["status"] == "waiting_input"
        assert await decide(recovered, approval_id, "approved") == "approved"
        assert (await h.result(recovered)).status == "completed"
        assert [w["outcome"] for w in await h.tickets.write_log()] == ["applied"]


@pytest.mark.timeout(240)
async def test_two_operators_at_once_reset_the_run_once(tmp_path) -> None:
    async with harness(tmp_path, dev_server=True) as h:
        handle = await h.start(task_text="t", script=one_write())
        state = await h.wait_for(handle, lambda s: bool(s.pending_approvals))
        (approval_id,) = state.pending_approvals
        await stall(h, handle)
        results = await asyncio.gather(
            recover_run(h.client, h.store, handle.id, "op-a", "stalled"),
            recover_run(h.client, h.store, handle.id, "op-b", "stalled too"),
            return_exceptions=True,
        )
        done = [r for r in results if isinstance(r, dict)]
        refused = [r for r in results if isinstance(r, ConflictError)]
        assert (len(done), len(refused)) == (1, 1), results
        executions = [w async for w in h.client.list_workflows(f"WorkflowId = '{handle.id}'")]
        assert len(executions) == 2  # the stalled one and one new: one reset
        recovered = h.client.get_workflow_handle(handle.id, result_type=RunResult)
        assert (await recovered.describe()).run_id == done[0]["execution"]
        await h.wait_for(recovered, lambda s: approval_id in s.pending_approvals)
        assert await decide(recovered, approval_id, "approved") == "approved"
        assert (await h.result(recovered)).status == "completed"
        assert [w["outcome"] for w in await h.tickets.write_log()] == ["applied"]


@pytest.mark.timeout(240)
async def test_a_healthy_run_is_not_reset_when_the_workers_run_other_code(tmp_path) -> None:
    """A rolling deploy: the workers run the other build, on which the run is
    healthy; an operator whose code cannot replay it must not reset it."""
    async with harness(tmp_path, dev_server=True) as h:
        await h.stop_worker()
        h.make_worker = other_build(h)
        await h.start_worker()
        handle = await h.start(task_text="t", script=one_write())
        await h.wait_for(handle, lambda s: bool(s.pending_approvals))
        await nudge(h.client, handle.id)
        await until(handle, _timer_then_task)
        execution = (await handle.describe()).run_id
        h.foreign.add(execution)  # the other build's history
        with pytest.raises(NotRecoverableError, match="tasks are not failing"):
            await recover_run(h.client, h.store, handle.id, "op-7", "looks odd")
        assert (await handle.describe()).run_id == execution
        assert [e["event_type"] for e in await h.store.list_events(handle.id)].count(
            "run.recovery_begun"
        ) == 0


@pytest.mark.timeout(240)
async def test_a_model_turn_in_the_dropped_tail_is_not_asked_again(tmp_path, monkeypatch) -> None:
    """A real model names its tool calls afresh on every call, and an action's
    key holds the call's id: a turn asked again after a reset would make its
    write a new action, approved again and run again. The turn's kept answer
    is given instead, so the reset run meets the write it already ran."""
    asked: Counter[tuple[str, int]] = Counter()
    answer = ScriptedModel.respond

    async def names_calls_afresh(self, request):  # type: ignore[no-untyped-def]
        response = await answer(self, request)
        asked[(request.seat, request.round)] += 1
        n = asked[(request.seat, request.round)]
        calls = [c.model_copy(update={"id": f"{c.id}-ask{n}"}) for c in response.tool_calls]
        usage = TokenUsage(prompt_tokens=100 * n + request.round, completion_tokens=n)
        return response.model_copy(update={"tool_calls": calls, "usage": usage})

    monkeypatch.setattr(ScriptedModel, "respond", names_calls_afresh)
    two_rounds = script(
        ("seat-1", 1, [ticket_call("ticket_update", "T-1")]),
        ("seat-1", 2, [ticket_call("ticket_update", "T-2")]),
    )
    async with harness(tmp_path, dev_server=True) as h:
        # The other build from the start: its first refresh is the divergence,
        # so round 1's turn, its approval and its write are all in the tail.
        await h.stop_worker()
        this_code, h.make_worker = h.make_worker, other_build(h)
        await h.start_worker()
        handle = await h.start(task_text="t", script=two_rounds, max_rounds=2)
        await nudge(h.client, handle.id)
        state = await h.wait_for(handle, lambda s: bool(s.pending_approvals))
        (first,) = state.pending_approvals
        assert await decide(handle, first, "approved", who="op-1") == "approved"
        await h.wait_for(
            handle,
            lambda s: bool(s.pending_approvals) and first not in s.pending_approvals,
            within=60,
        )
        assert [w["ticket_id"] for w in await h.tickets.write_log()] == ["T-1"]
        await h.stop_worker()
        h.foreign.add((await handle.describe()).run_id)
        h.make_worker = this_code
        await h.start_worker()
        await nudge(h.client, handle.id)
        await until_stalled(handle)

        done = await recover_run(h.client, h.store, handle.id, "op-7", "stalled")
        recovered = h.client.get_workflow_handle(handle.id, result_type=RunResult)
        again = await h.wait_for(recovered, lambda s: bool(s.pending_approvals), within=60)
        assert list(again.pending_approvals) == [
            a["id"]
            for a in await h.store.list_approvals(run_id=handle.id)
            if a["status"] == "pending"
        ]
        (second,) = again.pending_approvals
        assert await decide(recovered, second, "approved", who="op-2") == "approved"
        assert (await h.result(recovered)).status == "completed"

        assert sorted(w["ticket_id"] for w in await h.tickets.write_log()) == ["T-1", "T-2"]
        assert {("seat-1", 1), ("seat-1", 2)} <= set(asked)
        assert set(asked.values()) == {1}  # each turn asked once, reset or not
        actions = await h.store.list_actions(handle.id)
        assert sorted(a["status"] for a in actions) == ["succeeded", "succeeded"]
        approvals = await h.store.list_approvals(run_id=handle.id)
        assert sorted((a["status"], a["decided_by"]) for a in approvals) == [
            ("approved", "op-1"),
            ("approved", "op-2"),
        ]
        assert done["reset_to_event"] > 0
        # The reset kept the run's chain of executions: each turn's usage is
        # logged once, under that one chain, and the log adds up to what
        # the run itself reports having spent.
        turns = [
            e["payload"]
            for e in await h.store.list_events(handle.id)
            if e["event_type"] == "turn.completed"
        ]
        assert sorted((t["seat"], t["round"]) for t in turns) == sorted(set(asked))
        assert {t["chain"] for t in turns} == {handle.first_execution_run_id}
        result = await h.result(recovered)
        assert sum(t["prompt_tokens"] for t in turns) == result.usage.prompt_tokens
        await replays_strictly(await recovered.fetch_history(), h.client.data_converter)


@pytest.mark.timeout(240)
async def test_a_cancel_asked_while_stalled_is_carried_to_the_recovered_run(tmp_path) -> None:
    """Found in review: Temporal's reset carries signals and updates but not a
    cancel request, so a run cancelled while stalled went on after recovery
    and could still run its write."""
    async with harness(tmp_path, dev_server=True) as h:
        handle = await h.start(task_text="t", script=one_write())
        await h.wait_for(handle, lambda s: bool(s.pending_approvals))
        await stall(h, handle)
        await handle.cancel()
        done = await recover_run(h.client, h.store, handle.id, "op-7", WHY["note"])
        recovered = h.client.get_workflow_handle(handle.id, result_type=RunResult)
        with pytest.raises(WorkflowFailureError):
            await asyncio.wait_for(recovered.result(), 60)
        assert (await recovered.describe()).status == WorkflowExecutionStatus.CANCELED
        assert (await h.store.get_run(handle.id))["status"] == "cancelled"
        assert await h.tickets.write_log() == []  # the write never ran
        (approval,) = await h.store.list_approvals(run_id=handle.id)
        assert approval["status"] == "withdrawn"
        recovered_event = [
            e for e in await h.store.list_events(handle.id) if e["event_type"] == "run.recovered"
        ]
        assert recovered_event[0]["payload"]["cancel_carried"] is True
        assert recovered_event[0]["payload"]["execution"] == done["execution"]


@pytest.mark.timeout(240)
async def test_a_reset_whose_answer_is_lost_is_known_for_what_it_did(tmp_path, monkeypatch) -> None:
    """Found in review: a reset call that raised was recorded as failed even
    when Temporal had reset the run. Once the call fails before the reset
    (the claim is released, 503), once after it (recorded as recovered)."""
    async with harness(tmp_path, dev_server=True) as h:
        handle = await h.start(task_text="t", script=one_write())
        await h.wait_for(handle, lambda s: bool(s.pending_approvals))
        await stall(h, handle)
        stalled_execution = (await handle.describe()).run_id
        service = h.client.workflow_service
        real_reset = service.reset_workflow_execution
        lost = RPCError("connection reset", RPCStatusCode.UNAVAILABLE, b"")

        async def fails_first(*args, **kwargs):  # type: ignore[no-untyped-def]
            raise lost

        monkeypatch.setattr(service, "reset_workflow_execution", fails_first)
        monkeypatch.setattr("roundtable.recovery.OUTCOME_POLLS", 2)
        with pytest.raises(TemporalUnavailableError):
            await recover_run(h.client, h.store, handle.id, "op-7", WHY["note"])
        assert (await handle.describe()).run_id == stalled_execution  # not reset

        async def applies_then_fails(*args, **kwargs):  # type: ignore[no-untyped-def]
            await real_reset(*args, **kwargs)
            raise lost

        monkeypatch.setattr(service, "reset_workflow_execution", applies_then_fails)
        done = await recover_run(h.client, h.store, handle.id, "op-7", WHY["note"])
        assert done["execution"] == (await handle.describe()).run_id != stalled_execution
        kinds = [
            e["event_type"]
            for e in await h.store.list_events(handle.id)
            if e["event_type"].startswith("run.recover")
        ]
        assert kinds == [
            "run.recovery_begun",
            "run.recovery_failed",
            "run.recovery_begun",
            "run.recovered",
        ]


@pytest.mark.timeout(240)
async def test_a_cancel_asked_while_recovery_runs_is_carried_too(tmp_path, monkeypatch) -> None:
    """Found in review: the cancel was judged from what recovery read before
    its replays; one asked meanwhile was dropped by the reset."""
    async with harness(tmp_path, dev_server=True) as h:
        handle = await h.start(task_text="t", script=one_write())
        await h.wait_for(handle, lambda s: bool(s.pending_approvals))
        await stall(h, handle)
        search = recovery.first_divergent_task

        async def cancelled_meanwhile(*args, **kwargs):  # type: ignore[no-untyped-def]
            found = await search(*args, **kwargs)
            await handle.cancel()
            return found

        monkeypatch.setattr(recovery, "first_divergent_task", cancelled_meanwhile)
        await recover_run(h.client, h.store, handle.id, "op-7", WHY["note"])
        recovered = h.client.get_workflow_handle(handle.id, result_type=RunResult)
        with pytest.raises(WorkflowFailureError):
            await asyncio.wait_for(recovered.result(), 60)
        assert (await h.store.get_run(handle.id))["status"] == "cancelled"
        assert await h.tickets.write_log() == []
