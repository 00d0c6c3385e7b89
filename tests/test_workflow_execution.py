"""The non-retrying write path: leases, serialization, unknown outcomes, reconciliation."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import uuid
from datetime import datetime

import pytest
from temporalio import activity
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowUpdateFailedError

from roundtable.models import ReconcileInput
from roundtable.security import derive_target
from roundtable.store import NotFoundError
from roundtable.tools.registry import ToolRegistry
from tests.api_server import serve_api
from tests.workflow_harness import Harness, as_operator, harness, script, ticket_call
from workflows.roundtable import RoundtableWorkflow

AUTO = "auto_approve_up_to:R3"


def wrap_tool(registry: ToolRegistry, name: str, wrapper) -> None:  # type: ignore[no-untyped-def]
    original = registry.tools[name]
    registry.tools[name] = dataclasses.replace(original, handler=wrapper(original.handler))


def operator_says(action_id: str, outcome: str) -> ReconcileInput:
    """op-1's reconciliation, a request of its own, as the API sends it."""
    return as_operator(
        ReconcileInput(
            action_id=action_id,
            outcome=outcome,
            decided_by="op-1",
            note="checked",
            request_id=uuid.uuid4().hex,
        )
    )


async def reconcile(handle, action_id: str, outcome: str) -> str:  # type: ignore[no-untyped-def]
    return await handle.execute_update(
        RoundtableWorkflow.reconcile_action, operator_says(action_id, outcome)
    )


async def test_two_seats_on_one_ticket_are_serialized(tmp_path) -> None:
    both = script(
        ("seat-1", 1, [ticket_call("ticket_update", fields={"owner": "a"})]),
        ("seat-2", 1, [ticket_call("ticket_close")]),
    )
    async with harness(tmp_path, write_delay=0.3) as h:
        handle = await h.start(task_text="t", script=both, mode="parallel", write_policy=AUTO)
        assert (await handle.result()).status == "completed"
        log = await h.tickets.write_log()
        assert sorted(w["operation"] for w in log) == ["close", "update"]
        assert all(w["outcome"] == "applied" for w in log)
        first, second = sorted(log, key=lambda w: w["started_at"])
        assert datetime.fromisoformat(first["finished_at"]) <= datetime.fromisoformat(
            second["started_at"]
        ), "two writes to one ticket overlapped"
        assert [first["fencing_token"], second["fencing_token"]] == [1, 2]
        statuses = {a["status"] for a in await h.store.list_actions(handle.id)}
        assert statuses == {"succeeded"}


async def test_tool_error_after_acting_is_unknown_and_never_repeated(tmp_path) -> None:
    calls = []

    def acts_then_raises(handler):  # type: ignore[no-untyped-def]
        async def handle(args, ctx):  # type: ignore[no-untyped-def]
            calls.append(ctx.idempotency_key)
            await handler(args, ctx)
            raise ConnectionResetError("connection reset after the write")

        return handle

    async with harness(
        tmp_path, customize=lambda reg, _t: wrap_tool(reg, "ticket_update", acts_then_raises)
    ) as h:
        handle = await h.start(
            task_text="t",
            script=script(("seat-1", 1, [ticket_call("ticket_update")])),
            write_policy=AUTO,
        )
        state = await h.wait_for(handle, lambda s: bool(s.unknown_actions))
        assert state.status == "waiting_input"
        (action_id,) = state.unknown_actions
        action = await h.store.get_action(action_id)
        assert action["status"] == "unknown"
        assert action["result"] == {
            "error_code": "tool_error",
            "error_type": "ConnectionResetError",
            "message": "connection reset after the write",
        }
        assert (await h.store.get_run(handle.id))["status"] == "waiting_input"
        assert len(calls) == 1
        assert [w["outcome"] for w in await h.tickets.write_log()] == ["applied"]

        assert await reconcile(handle, action_id, "succeeded") == "succeeded"
        assert (await handle.result()).status == "completed"
        assert len(calls) == 1
        assert (await h.store.get_action(action_id))["status"] == "succeeded"
        told = [
            json.loads(m.content)
            for m in (await h.state(handle)).threads["seat-1"]
            if m.role == "tool"
        ]
        assert told[0]["outcome"] == "succeeded" and told[0]["result"]["reconciled"] is True


async def test_lost_heartbeat_is_unknown_and_the_tool_is_not_called_again(
    tmp_path, monkeypatch
) -> None:
    """A worker whose heartbeats stop reaching Temporal: the server times the
    activity out, the workflow settles the action as unknown, nothing retries.
    The attempt is still alive on the worker: its next lease renewal is
    refused, which cancels the tool call; only then may it be reconciled."""
    calls, cancelled = [], []
    never = asyncio.Event()

    def hangs(handler):  # type: ignore[no-untyped-def]
        async def handle(args, ctx):  # type: ignore[no-untyped-def]
            calls.append(ctx.idempotency_key)
            try:
                await never.wait()
            except asyncio.CancelledError:
                cancelled.append(ctx.idempotency_key)
                raise

        return handle

    monkeypatch.setattr(activity, "heartbeat", lambda *details: None)  # the worker is "dead"
    async with harness(
        tmp_path, customize=lambda reg, _t: wrap_tool(reg, "ticket_update", hangs)
    ) as h:
        handle = await h.start(
            task_text="t",
            script=script(("seat-1", 1, [ticket_call("ticket_update")])),
            write_policy=AUTO,
            heartbeat_timeout_seconds=2,
            lease_seconds=30,
        )
        state = await h.wait_for(handle, lambda s: bool(s.unknown_actions), within=30)
        (action_id,) = state.unknown_actions
        action = await h.store.get_action(action_id)
        assert action["status"] == "unknown"
        assert action["result"]["error_code"] == "execution_interrupted"
        assert calls == [action["idempotency_key"]]
        await attempt_ended(h, handle.id, action_id)
        assert cancelled == calls
        # What the attempt saw, kept for whoever reconciles it.
        assert (await h.store.get_action(action_id))["result"]["attempt_reported"] == {
            "status": "unknown",
            "result": {"error_code": "lease_lost", "reason": "action_no_longer_executing"},
        }
        await reconcile(handle, action_id, "failed")
        assert (await handle.result()).status == "completed"
        assert len(calls) == 1


async def attempt_ended(h: Harness, run_id: str, action_id: str, within: float = 20) -> None:
    """Until the action's attempt has said it is over (its lease clock stopped)."""
    for _ in range(int(within / 0.05)):
        events = await h.store.list_events(run_id)
        if any(
            e["event_type"] == "action.attempt_ended" and e["payload"]["action_id"] == action_id
            for e in events
        ):
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the attempt never ended")


async def hold_target(h: Harness, ticket: str) -> str:
    """Another run claims the ticket first, through the store like any worker."""
    snapshot = h.registry.snapshot(["seat-9"]).model_dump()
    target = derive_target(
        "ticket_update", {"tenant_id": "acme", "ticket_id": ticket}, snapshot, "seat-9"
    )
    session = await h.store.create_session(user_id="other", task_text="other run")
    run = await h.store.create_run(session_id=session["id"], user_id="other")
    holder = await h.store.create_action(
        {
            "session_id": session["id"],
            "run_id": run["id"],
            "agent_id": "seat-9",
            "tool_name": "ticket_update",
            "idempotency_key": f"holder-{ticket}",
            "target_key": target.key,
            "target_scope": target.scope,
            "risk_level": "R2",
            "status": "approved",
        }
    )
    assert await h.store.claim_action_for_execution(holder["id"], 300) == "claimed"
    return holder["id"]


async def test_busy_target_waits_on_timers_then_proceeds(tmp_path) -> None:
    async with harness(tmp_path) as h:
        holder = await hold_target(h, "T-1")
        handle = await h.start(
            task_text="t",
            script=script(("seat-1", 1, [ticket_call("ticket_update")])),
            write_policy=AUTO,
        )
        await asyncio.sleep(1.5)  # real time: the workflow keeps finding the target busy
        (action,) = await h.store.list_actions(handle.id)
        assert action["status"] == "approved" and action["attempt_count"] == 0
        history = await handle.fetch_history()
        assert any(e.HasField("timer_started_event_attributes") for e in history.events)

        await h.store.record_action_terminal_result(holder, "succeeded", {})
        assert (await handle.result()).status == "completed"
        assert (await h.store.get_action(action["id"]))["status"] == "succeeded"


async def test_target_blocked_by_unknown_waits_for_reconciliation(tmp_path) -> None:
    async with harness(tmp_path) as h:
        holder = await hold_target(h, "T-1")
        await h.store.record_action_terminal_result(
            holder, "unknown", {"error_code": "x"}, attempt_over=True
        )
        handle = await h.start(
            task_text="t",
            script=script(("seat-1", 1, [ticket_call("ticket_update")])),
            write_policy=AUTO,
        )
        state = await h.wait_for(handle, lambda s: bool(s.blocked_writes))
        assert state.status == "waiting_input"
        assert (await h.store.get_run(handle.id))["status"] == "waiting_input"
        await h.store.reconcile_action(holder, "failed", "op", "did not happen")
        assert (await handle.result()).status == "completed"
        assert len(await h.tickets.write_log()) == 1


async def test_reconcile_validator_refuses_actions_not_awaiting_it(tmp_path) -> None:
    async with harness(tmp_path) as h:
        handle = await h.start(
            task_text="t", script=script(("seat-1", 1, [ticket_call("ticket_update")]))
        )
        await h.wait_for(handle, lambda s: bool(s.pending_approvals))
        with pytest.raises(WorkflowUpdateFailedError):
            await reconcile(handle, "not-an-action", "failed")
        await handle.terminate()


async def test_a_tool_errors_message_is_kept_without_the_arguments(tmp_path) -> None:
    canary = "CANARY-sk-live-7f3a"

    def echoes_its_arguments(handler):  # type: ignore[no-untyped-def]
        async def handle(args, ctx):  # type: ignore[no-untyped-def]
            raise RuntimeError(f"upstream said 502 while posting body={args.body!r}")

        return handle

    # Escaped when quoted (a newline, quotes): redaction must see through it.
    comment = ticket_call("ticket_comment", body=f'please call me,\n"{canary}"')
    async with harness(
        tmp_path, customize=lambda reg, _t: wrap_tool(reg, "ticket_comment", echoes_its_arguments)
    ) as h:
        handle = await h.start(
            task_text="t", script=script(("seat-1", 1, [comment])), write_policy=AUTO
        )
        state = await h.wait_for(handle, lambda s: bool(s.unknown_actions))
        (action_id,) = state.unknown_actions
        result = (await h.store.get_action(action_id))["result"]
        assert result["error_type"] == "RuntimeError"
        assert result["message"].startswith("upstream said 502 while posting body=")
        assert canary not in json.dumps(result) and "[redacted]" in result["message"]
        assert canary not in json.dumps(
            [e["payload"] for e in await h.store.list_events(handle.id)]
        )
        await handle.terminate()


CANARY = "CANARY-sk-live-7f3a"


@contextlib.asynccontextmanager
async def one_comment(tmp_path, wrapper):  # type: ignore[no-untyped-def]
    """One auto-approved ticket comment whose body holds ``CANARY``, through a
    wrapped ticket_comment tool, run to its end; yields the harness, the API
    and the workflow's handle."""
    comment = ticket_call("ticket_comment", "T-7", body=f"note {CANARY} please")
    async with (
        harness(tmp_path, customize=lambda reg, _t: wrap_tool(reg, "ticket_comment", wrapper)) as h,
        serve_api(h) as api,
    ):
        handle = await h.start(
            task_text="t", script=script(("seat-1", 1, [comment])), write_policy=AUTO
        )
        await handle.result()
        yield h, api, handle


async def where_results_are_seen(h: Harness, api, handle) -> list[str]:  # type: ignore[no-untyped-def]
    """Each place a write's outcome is kept or shown: the action rows, the
    API's actions view, the audit events, and the tool's answers as the
    agent reads them (its own call carries the arguments: it wrote them)."""
    actions = await h.store.list_actions(handle.id)
    shown = await api.http.get(f"/v1/runs/{handle.id}/actions", headers=api.auth("ops"))
    assert shown.status_code == 200, shown.text
    events = [e["payload"] for e in await h.store.list_events(handle.id)]
    thread = (await h.state(handle)).threads["seat-1"]
    answers = [m.content for m in thread if m.role == "tool"]
    assert answers
    return [json.dumps([a["result"] for a in actions]), shown.text, json.dumps(events), *answers]


async def test_a_result_that_echoes_the_arguments_is_kept_without_them(tmp_path) -> None:
    """A tool that succeeds may answer with what it was given (the ticket
    system returns the ticket, its new comment included). The result is
    stored in plain text, served by the API and read by the agents: the
    secret argument was in all three."""

    def answers_with_its_arguments(handler):  # type: ignore[no-untyped-def]
        async def handle(args, ctx):  # type: ignore[no-untyped-def]
            done = await handler(args, ctx)
            return {
                **done,
                "echo": {"body": args.body, CANARY: [1, args.body.upper()]},
                "quoted": f"posted {args.body[5:17]!r}",
                "pin": 73519,
            }

        return handle

    async with one_comment(tmp_path, answers_with_its_arguments) as (h, api, handle):
        (action,) = await h.store.list_actions(handle.id)
        assert action["status"] == "succeeded"
        stored = action["result"]
        assert stored["ticket_id"] == "T-7"  # a safe field stays as it was
        withheld = "[value withheld: it quoted the tool's arguments]"
        assert stored["echo"] == {"body": "[redacted]", withheld: [1, "[redacted]"]}
        assert stored["quoted"] == withheld
        assert stored["pin"] == 73519  # not an argument: kept
        for seen in await where_results_are_seen(h, api, handle):
            assert CANARY.lower() not in seen.lower()


async def test_a_write_whose_arguments_cannot_be_opened_fails_and_never_runs(tmp_path) -> None:
    """The claim hands over the sealed arguments; arguments that will not
    decrypt (sealed for another action, a rotated key) are a definite
    failure: nothing was invoked, so nothing is unknown."""
    from roundtable.models import Decision
    from roundtable.security import encrypt_arguments
    from roundtable.store.schema import ActionSecretRow
    from tests.helpers import set_column

    async with harness(tmp_path) as h:
        handle = await h.start(
            task_text="t", script=script(("seat-1", 1, [ticket_call("ticket_update")]))
        )
        state = await h.wait_for(handle, lambda s: bool(s.pending_approvals))
        (approval_id,) = state.pending_approvals
        (action,) = await h.store.list_actions(handle.id)
        foreign = encrypt_arguments({"fields": {"p": "low"}}, associated_data=b"another-action")
        await set_column(
            h.store,
            ActionSecretRow,
            ActionSecretRow.action_id == action["id"],
            arguments_encrypted=foreign,
        )
        await handle.execute_update(
            RoundtableWorkflow.decide_approval,
            Decision(approval_id=approval_id, decision="approved", decided_by="op-1"),
        )
        assert (await handle.result()).status == "completed"
        (action,) = await h.store.list_actions(handle.id)
        assert action["status"] == "failed"
        assert action["result"]["error_code"] == "arguments_unreadable"
        assert await h.tickets.write_log() == []


async def test_one_writes_end_does_not_erase_anothers_blocked_reason(tmp_path) -> None:
    """Two seats write at once: one to a ticket an unknown action blocks, one
    to a free ticket. When the free one's write ends, the run still shows
    that it waits for a reconciliation (one shared line once made it say
    `running`, found by the scale-out load test)."""
    both = script(
        ("seat-1", 1, [ticket_call("ticket_update", "T-1")]),
        ("seat-2", 1, [ticket_call("ticket_update", "T-2")]),
    )
    async with harness(tmp_path) as h:
        holder = await hold_target(h, "T-1")
        await h.store.record_action_terminal_result(
            holder, "unknown", {"error_code": "x"}, attempt_over=True
        )
        handle = await h.start(task_text="t", script=both, mode="parallel", write_policy=AUTO)
        for _ in range(200):  # until the free ticket's write has ended
            with contextlib.suppress(NotFoundError):  # the run is not recorded yet
                actions = await h.store.list_actions(handle.id)
                if any(a["status"] == "succeeded" for a in actions):
                    break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the free ticket's write never ended")
        state = await h.wait_for(handle, lambda s: bool(s.blocked_writes))
        (why,) = state.blocked_writes.values()
        assert "seat-1 waits: another action on its target is unknown" in why
        assert state.status == "waiting_input"
        assert (await h.store.get_run(handle.id))["status"] == "waiting_input"
        await h.store.reconcile_action(holder, "failed", "op", "did not happen")
        done = await h.wait_for(handle, lambda s: s.status == "completed")
        assert done.blocked_writes == {}


@pytest.mark.parametrize(
    "returned",
    [{"note": "a\x00b", "ratio": float("nan")}, {"note": "a\ud800c"}],
    ids=["nul-and-nan", "lone-surrogate"],
)
async def test_the_seat_is_told_the_result_as_the_action_row_keeps_it(
    tmp_path, returned: dict
) -> None:
    """What the store keeps of a result is not always what the tool returned
    (NUL, a lone surrogate and NaN are escaped to be storable); the seat, the
    API and the audit must agree on one. Found in review of a cut that told
    the workflow the result as returned: the seat heard null for NaN, and a
    lone surrogate failed the write's activity after its result committed."""

    def awkward_result(handler):  # type: ignore[no-untyped-def]
        async def handle(args, ctx):  # type: ignore[no-untyped-def]
            await handler(args, ctx)
            return returned

        return handle

    async with one_comment(tmp_path, awkward_result) as (h, api, handle):
        assert (await handle.result()).status == "completed"
        (action,) = await h.store.list_actions(handle.id)
        assert action["status"] == "succeeded" and action["attempt_count"] == 1
        (told,) = [m for m in (await h.state(handle)).threads["seat-1"] if m.role == "tool"]
        assert json.loads(told.content)["result"] == action["result"]
        shown = await api.http.get(f"/v1/runs/{handle.id}/actions", headers=api.auth("ops"))
        assert [a["result"] for a in shown.json()] == [action["result"]], shown.text
        failed = [
            e async for e in handle.fetch_history_events()
            if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_FAILED
        ]  # fmt: skip
        assert failed == []
