"""Nobody approves their own way around a person: the server caps the write
policy by role (and the worker again for runs started straight through
Temporal), separates who starts from who approves, keeps high-risk writes for
operators, and keeps tenant-limited users inside their tenants."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Any

import pytest
from temporalio.client import WorkflowFailureError, WorkflowUpdateFailedError
from temporalio.common import WorkflowIDReusePolicy

from roundtable.config import Settings
from roundtable.models import (
    Attestation,
    Decision,
    ExtendInput,
    ExtendOutput,
    RunInput,
    RunResult,
    RunState,
    WorkflowArgs,
)
from roundtable.permissions import Authority, PolicyNotAllowedError, capped_policy
from roundtable.store import InvalidInputError
from tests.api_server import Api, serve_api
from tests.workflow_harness import Harness, as_operator, harness, script, ticket_call
from workflows.roundtable import RoundtableWorkflow


@asynccontextmanager
async def same_rules(tmp_path: Any, **settings: Any) -> AsyncIterator[tuple[Harness, Api]]:
    """A worker and an API that read the same settings, as in a deployment."""
    async with (
        harness(tmp_path, authority=authority(**settings)) as h,
        serve_api(h, **settings) as api,
    ):
        yield h, api


def authority(**settings: Any) -> Authority:
    """The rules a worker reads from its environment, here from ``settings``."""
    return Authority.from_settings(Settings(**settings))


async def start(api: Api, who: str, calls: list[dict[str, Any]], **fields: Any) -> Any:
    return await api.http.post(
        "/v1/runs",
        json={"task_text": "t", "script": script(("seat-1", 1, calls)), **fields},
        headers=api.auth(who),
    )


async def pending(h: Harness, run_id: str) -> tuple[str, dict[str, Any]]:
    state = await h.wait_for(
        h.client.get_workflow_handle(run_id), lambda s: bool(s.pending_approvals)
    )
    (approval_id,) = state.pending_approvals
    approval = await h.store.get_approval(approval_id)
    return approval_id, await h.store.get_action(approval["action_id"])


async def until_stored(h: Harness, run_id: str, status: str) -> None:
    for _ in range(400):
        if (await h.store.get_run(run_id))["status"] == status:
            return
        await asyncio.sleep(0.025)
    raise AssertionError(f"run {run_id} never stored as {status}")


async def decide(api: Api, who: str, approval_id: str, action: dict[str, Any], **body: Any) -> Any:
    return await api.http.post(
        f"/v1/approvals/{approval_id}/decision",
        json={"decision": "approved", "arguments_digest": action["arguments_digest"], **body},
        headers=api.auth(who),
    )


def test_policies_are_ordered_and_a_ceiling_caps_them() -> None:
    rules = authority()
    assert capped_policy("auto_approve_up_to:R3", "confirm_all_writes") == "confirm_all_writes"
    assert capped_policy("deny_writes", "auto_approve_up_to:R1") == "deny_writes"
    rules.check_policy("operator", "auto_approve_up_to:R1")
    rules.check_policy("user", "deny_writes")
    for role, policy in (("user", "auto_approve_up_to:R0"), ("operator", "auto_approve_up_to:R2")):
        with pytest.raises(PolicyNotAllowedError):
            rules.check_policy(role, policy)
    with pytest.raises(ValueError, match="POLICY_CEILING_USER"):
        authority(policy_ceiling_user="anything_goes")
    with pytest.raises(InvalidInputError):
        rules.check_policy("user", "yolo")


async def test_a_user_cannot_switch_approval_off_through_the_api(tmp_path) -> None:
    """Once a user token started auto_approve_up_to:R3 and closed a ticket with
    no person involved."""
    close = [ticket_call("ticket_close", "T-9")]
    async with harness(tmp_path, authority=authority()) as h, serve_api(h) as api:
        for who in ("alice", "svc"):
            extra = {"user_id": "alice"} if who == "svc" else {}
            refused = await start(api, who, close, write_policy="auto_approve_up_to:R3", **extra)
            assert refused.status_code == 403, refused.text
            assert refused.json()["code"] == "policy_not_allowed"
        operator_too_far = await start(api, "ops", close, write_policy="auto_approve_up_to:R2")
        assert operator_too_far.json()["code"] == "policy_not_allowed"
        assert await h.store.list_runs() == []  # nothing was created
        assert await h.tickets.write_log() == []

        # Within the ceiling: a person still decides the close.
        allowed = await start(api, "alice", close, write_policy="confirm_all_writes")
        assert allowed.status_code == 201, allowed.text
        await pending(h, allowed.json()["run_id"])


async def test_the_operator_ceiling_lets_operators_auto_approve_low_risk(tmp_path) -> None:
    comment = [ticket_call("ticket_comment", "T-3")]
    async with harness(tmp_path, authority=authority()) as h, serve_api(h) as api:
        started = await start(api, "ops", comment, write_policy="auto_approve_up_to:R1")
        assert started.status_code == 201, started.text
        result = await h.client.get_workflow_handle(started.json()["run_id"]).result()
        assert result["status"] == "completed"
        (action,) = await h.store.list_actions(started.json()["run_id"])
        assert action["status"] == "succeeded"  # no person was asked: R1 ≤ R1


async def test_a_run_started_straight_through_temporal_gets_the_service_ceiling(
    tmp_path,
) -> None:
    """The typed client, `temporal workflow start`: no API to check, so the
    worker does, and says why in the run's failure."""
    calls = [ticket_call("ticket_close", "T-9")]
    async with harness(tmp_path, authority=authority()) as h:
        handle = await h.start(
            task_text="t", script=script(("seat-1", 1, calls)), write_policy="auto_approve_up_to:R3"
        )
        with pytest.raises(WorkflowFailureError):
            await handle.result()
        run = await h.store.get_run(handle.id)
        assert run["status"] == "failed"
        assert run["failure"]["code"] == "policy_not_allowed", run["failure"]
        assert await h.store.list_actions(handle.id) == []
        assert await h.tickets.write_log() == []

        # A policy at or under the service ceiling runs as before.
        fine = await h.start(task_text="t", script=script(("seat-1", 1, calls)))
        await h.wait_for(fine, lambda s: bool(s.pending_approvals))


async def test_a_service_ceiling_can_be_raised_by_the_server_only(tmp_path) -> None:
    rules = authority(policy_ceiling_service="auto_approve_up_to:R1")
    calls = [ticket_call("ticket_comment", "T-4")]
    async with harness(tmp_path, authority=rules) as h:
        handle = await h.start(
            task_text="t", script=script(("seat-1", 1, calls)), write_policy="auto_approve_up_to:R1"
        )
        assert (await handle.result()).status == "completed"


async def test_separation_of_duties_the_starter_may_not_approve(tmp_path) -> None:
    calls = [ticket_call("ticket_update", "T-5")]
    async with same_rules(tmp_path, approvers="others") as (h, api):
        run_id = (await start(api, "alice", calls)).json()["run_id"]
        approval_id, action = await pending(h, run_id)
        own = await decide(api, "alice", approval_id, action)
        assert own.status_code == 403, own.text
        assert own.json()["code"] == "self_approval_not_allowed"

        # A raw signal or update vouches for nobody: refused, still pending.
        handle = h.client.get_workflow_handle(run_id, result_type=RunResult)
        raw = Decision(
            approval_id=approval_id,
            decision="approved",
            decided_by="ops",
            # Claimed, not attested: a made-up stamp vouches for nobody.
            attested_by=Attestation(role="operator", at=datetime.now(UTC), mac="0" * 64),
        )
        with pytest.raises(WorkflowUpdateFailedError) as refused:
            await handle.execute_update(RoundtableWorkflow.decide_approval, raw)
        assert "API or CLI" in str(refused.value.cause)
        await handle.signal(RoundtableWorkflow.approval_decision, raw)
        assert (await h.store.get_approval(approval_id))["status"] == "pending"

        by_operator = await decide(api, "ops", approval_id, action)
        assert by_operator.status_code == 200, by_operator.text
        assert (await handle.result()).status == "completed"
        assert (await h.store.get_approval(approval_id))["decided_by"] == "ops"


async def test_high_risk_writes_are_decided_by_operators_only(tmp_path) -> None:
    calls = [ticket_call("ticket_close", "T-6")]
    async with harness(tmp_path, authority=authority()) as h, serve_api(h) as api:
        run_id = (await start(api, "alice", calls)).json()["run_id"]
        approval_id, action = await pending(h, run_id)
        owner = await decide(api, "alice", approval_id, action)
        assert owner.status_code == 403 and owner.json()["code"] == "operator_required"
        rejected = await decide(api, "alice", approval_id, action, decision="rejected")
        assert rejected.json()["code"] == "operator_required"  # either way

        handle = h.client.get_workflow_handle(run_id, result_type=RunResult)
        await handle.signal(
            RoundtableWorkflow.approval_decision,
            Decision(approval_id=approval_id, decision="approved", decided_by="mallory"),
        )
        assert (await h.store.get_approval(approval_id))["status"] == "pending"

        assert (await decide(api, "ops", approval_id, action)).status_code == 200
        assert (await handle.result()).status == "completed"


async def test_a_tenant_limited_user_writes_only_for_their_tenants(tmp_path) -> None:
    calls = [
        ticket_call("ticket_update", "T-7", tenant_id="acme"),
        ticket_call("ticket_update", "T-8", tenant_id="initech"),
    ]
    async with harness(tmp_path, authority=authority()) as h, serve_api(h) as api:
        run_id = (await start(api, "carol", calls)).json()["run_id"]
        approval_id, action = await pending(h, run_id)
        assert action["arguments"]["tenant_id"] == "initech"  # only this one became an action
        (only,) = await h.store.list_actions(run_id)
        assert only["id"] == action["id"]
        events = await h.store.list_events(run_id)
        (refusal,) = [e for e in events if e["event_type"] == "action.refused"]
        assert refusal["payload"]["code"] == "tenant_not_allowed"

        # Approve-with-edits cannot move the write to another tenant.
        moved = await decide(
            api,
            "carol",
            approval_id,
            action,
            arguments={"tenant_id": "acme", "ticket_id": "T-8", "fields": {"p": "1"}},
        )
        assert moved.status_code == 403, moved.text
        assert moved.json()["code"] == "tenant_not_allowed"
        assert (await h.store.get_approval(approval_id))["status"] == "pending"
        assert (await decide(api, "carol", approval_id, action)).status_code == 200
        await h.client.get_workflow_handle(run_id).result()
        assert [w["ticket_id"] for w in await h.tickets.write_log()] == ["T-8"]
        thread = (await h.state(h.client.get_workflow_handle(run_id))).threads["seat-1"]
        assert "tenant_not_allowed" in repr(thread)  # the seat was told


async def test_an_operator_cannot_edit_a_write_out_of_the_runs_tenants(tmp_path) -> None:
    calls = [ticket_call("ticket_update", "T-8", tenant_id="initech")]
    async with harness(tmp_path, authority=authority()) as h, serve_api(h) as api:
        run_id = (await start(api, "carol", calls)).json()["run_id"]
        approval_id, action = await pending(h, run_id)
        moved = await decide(
            api,
            "ops",
            approval_id,
            action,
            arguments={"tenant_id": "acme", "ticket_id": "T-8", "fields": {"p": "1"}},
        )
        assert moved.json()["code"] == "tenant_not_allowed"


async def test_only_allowed_models_start(tmp_path) -> None:
    calls: list[dict[str, Any]] = []
    async with harness(tmp_path, authority=authority()) as h, serve_api(h) as api:
        refused = await start(api, "alice", calls, model="openai:gpt-none")
        assert refused.status_code == 422 and refused.json()["code"] == "model_not_allowed"
        seat_model = await start(api, "alice", calls, seat_models={"seat-1": "openai:x"})
        assert seat_model.json()["code"] == "model_not_allowed"

        handle = await h.start(task_text="t", model="openai:gpt-none")
        with pytest.raises(WorkflowFailureError):
            await handle.result()
        assert (await h.store.get_run(handle.id))["failure"]["code"] == "model_not_allowed"

    allowed = authority(allowed_models=["scripted", "openai:gpt-4o"])
    allowed.check_models(["openai:gpt-4o"])
    assert "openai:m" in authority(default_model="openai:m").allowed_models


# --------------------------------------------------------- found in review


async def test_a_workflow_that_borrows_an_operator_runs_id_gets_no_grant(tmp_path) -> None:
    """A workflow started straight through Temporal, under another id, naming
    an operator run's run_id and owner, once inherited its grant and wrote
    unapproved; it also marked the real run completed."""
    async with harness(tmp_path, authority=authority()) as h, serve_api(h) as api:
        calls = [ticket_call("ticket_update", "T-OPS")]
        started = await start(api, "ops", calls, write_policy="auto_approve_up_to:R1")
        run_id = started.json()["run_id"]
        await pending(h, run_id)
        # The store may show the wait a moment after the workflow does.
        await until_stored(h, run_id, "waiting_input")
        evil = RunInput(
            run_id=run_id,
            user_id="ops",
            task_text="evil",
            write_policy="auto_approve_up_to:R1",
            seats=["seat-9"],
            script=script(("seat-9", 1, [ticket_call("ticket_comment", "T-EVIL")])),
        )
        handle = await h.client.start_workflow(
            RoundtableWorkflow.run,
            WorkflowArgs(request=evil),
            id=f"evil-{run_id}",
            task_queue=h.task_queue,
        )
        # In real time: a time-skipping wait may jump to the operator run's
        # approval deadline, and that run would leave waiting_input.
        with h.env.auto_time_skipping_disabled(), pytest.raises(WorkflowFailureError):
            await h.result(handle)
        assert not any(w["ticket_id"] == "T-EVIL" for w in await h.tickets.write_log())
        assert (await h.store.get_run(run_id))["status"] == "waiting_input"


async def test_the_same_run_id_with_another_request_gets_no_grant(tmp_path) -> None:
    """The grant holds for the request the API checked, field for field."""
    rules = authority()
    grant = {"granted_write_policy": "auto_approve_up_to:R1", "started_by_role": "operator"}
    run = {**grant, "request_fingerprint": "a" * 64}
    assert rules.granted_policy(run, "auto_approve_up_to:R1", "a" * 64) == "auto_approve_up_to:R1"
    assert rules.granted_policy(run, "auto_approve_up_to:R1", "b" * 64) == "confirm_all_writes"


async def test_an_operators_attestation_copied_from_history_vouches_for_nothing_else(
    tmp_path,
) -> None:
    """An operator's refused edit stays in the history with its attestation;
    resent with other edits, or none, it once approved as the operator."""
    calls = [ticket_call("ticket_update", "T-5", fields={"refund": "10000"})]
    async with same_rules(tmp_path, approvers="others") as (h, api):
        run_id = (await start(api, "alice", calls)).json()["run_id"]
        approval_id, action = await pending(h, run_id)
        typo = {"tenant_id": "acme", "ticket_id": "T-5", "feilds": {"refund": "10"}}
        refused = await decide(api, "ops", approval_id, action, arguments=typo)
        assert refused.status_code == 422
        handle = h.client.get_workflow_handle(run_id, result_type=RunResult)
        copied = None
        async for event in handle.fetch_history_events():
            if event.HasField("workflow_execution_update_accepted_event_attributes"):
                request = event.workflow_execution_update_accepted_event_attributes
                (copied,) = await h.client.data_converter.decode(
                    list(request.accepted_request.input.args.payloads), [Decision]
                )
        assert copied is not None and copied.attested_by is not None
        mine = {"tenant_id": "acme", "ticket_id": "T-5", "fields": {"refund": "99999"}}
        for replay in (
            copied.model_copy(update={"arguments": mine}),
            copied.model_copy(update={"arguments": None}),
        ):
            with pytest.raises(WorkflowUpdateFailedError):
                await handle.execute_update(RoundtableWorkflow.decide_approval, replay)
        assert (await h.store.get_approval(approval_id))["status"] == "pending"


async def test_a_tenant_limited_user_cannot_approve_another_tenants_write(tmp_path) -> None:
    calls = [ticket_call("ticket_update", "T-1", tenant_id="acme")]
    async with harness(tmp_path, authority=authority()) as h, serve_api(h) as api:
        run_id = (await start(api, "svc", calls, user_id="carol")).json()["run_id"]
        approval_id, action = await pending(h, run_id)
        plain = await decide(api, "carol", approval_id, action)
        assert plain.status_code == 403 and plain.json()["code"] == "tenant_not_allowed"
        assert (await h.store.get_approval(approval_id))["status"] == "pending"


async def test_a_tenant_limited_run_reads_only_its_tenants(tmp_path) -> None:
    read = {"name": "ticket_get", "args": {"tenant_id": "acme", "ticket_id": "T-SECRET"}}
    async with harness(tmp_path, authority=authority()) as h, serve_api(h) as api:
        run_id = (await start(api, "carol", [read])).json()["run_id"]
        handle = h.client.get_workflow_handle(run_id, result_type=RunResult)
        await handle.result()
        thread = repr((await h.state(handle)).threads["seat-1"])
        assert "tenant_not_allowed" in thread and "open" not in thread.split("tenant_not")[1]


async def test_a_raw_reconcile_update_is_refused(tmp_path) -> None:
    """Reconciling is for operators; a raw update once settled unknown writes
    as whoever it named."""
    from roundtable.models import ReconcileInput
    from tests.test_closed_runs import AUTO, acts_then_raises, update
    from tests.test_workflow_execution import wrap_tool

    async with harness(
        tmp_path,
        authority=authority(policy_ceiling_service=AUTO),
        customize=lambda reg, _t: wrap_tool(reg, "ticket_update", acts_then_raises),
    ) as h:
        handle = await h.start(task_text="t", script=update(), write_policy=AUTO)
        state = await h.wait_for(handle, lambda s: bool(s.unknown_actions))
        (action_id,) = state.unknown_actions
        raw = ReconcileInput(
            action_id=action_id,
            outcome="succeeded",
            decided_by="ops",
            note="x",
            request_id="ops-1",
        )
        with pytest.raises(WorkflowUpdateFailedError) as refused:
            await handle.execute_update(RoundtableWorkflow.reconcile_action, raw)
        assert "operator" in str(refused.value.cause)
        assert (await h.store.get_action(action_id))["status"] == "unknown"
        await handle.execute_update(RoundtableWorkflow.reconcile_action, as_operator(raw))
        assert (await h.store.get_action(action_id))["status"] == "succeeded"


def forged(snapshot: Any) -> Any:
    """A capability snapshot that calls every tool R0."""
    tools = tuple(t.model_copy(update={"risk_level": "R0"}) for t in snapshot.tools)
    return snapshot.model_copy(update={"tools": tools})


async def test_a_made_up_carried_state_gets_no_grant_and_no_lower_risk(tmp_path) -> None:
    """Found in a second review: a workflow started straight through Temporal
    with a made-up carried state skipped the start's checks: it reused an
    operator run's id (after terminating it) and its grant, and called an R3
    write R0 so that a raw signal could approve it."""
    async with harness(tmp_path, authority=authority()) as h, serve_api(h) as api:
        for lie in ("risk", "request"):
            calls = [ticket_call("ticket_update", "T-OPS")]
            started = await start(api, "ops", calls, write_policy="auto_approve_up_to:R1")
            run_id = started.json()["run_id"]
            await pending(h, run_id)
            legit = h.client.get_workflow_handle(run_id)
            snapshot = (await h.state(legit)).snapshot  # readable by anyone with the UI
            await legit.terminate("someone with Temporal access")
            run = await h.store.get_run(run_id)
            request = RunInput(
                run_id=run_id,
                task_text="anything",
                user_id="ops",
                write_policy="auto_approve_up_to:R1",
                script=script(("seat-1", 1, [{**ticket_call("ticket_close", "T-9"), "id": "x"}])),
            )
            carried = RunState(
                run_id=run_id,
                session_id=run["session_id"],
                status="running",
                snapshot=forged(snapshot) if lie == "risk" else snapshot,
                threads={"seat-1": [], "seat-2": []},
            )
            handle = await h.client.start_workflow(
                RoundtableWorkflow.run,
                WorkflowArgs(request=request, carried=carried),
                id=run_id,
                task_queue=h.task_queue,
                id_reuse_policy=WorkflowIDReusePolicy.ALLOW_DUPLICATE,
            )
            if lie == "request":
                # The real snapshot, another request: no grant, so a person
                # decides, and not one a raw signal names (R3 is for operators).
                state = await h.wait_for(handle, lambda s: bool(s.pending_approvals))
                (approval_id,) = state.pending_approvals
                await handle.signal(
                    RoundtableWorkflow.approval_decision,
                    Decision(approval_id=approval_id, decision="approved", decided_by="m"),
                )
                await asyncio.sleep(0.5)
                assert (await h.store.get_approval(approval_id))["status"] == "pending"
                await handle.terminate("done probing")
            else:
                with pytest.raises(WorkflowFailureError):
                    await handle.result()
                actions = await h.store.list_actions(run_id)
                assert not [a for a in actions if a["tool_name"] == "ticket_close"]
        assert not any(w["ticket_id"] == "T-9" for w in await h.tickets.write_log())


async def test_a_raw_extension_keeps_the_workers_limits_and_names_nobody(tmp_path) -> None:
    calls = [ticket_call("ticket_update", "T-5")]
    async with harness(tmp_path, authority=authority()) as h:
        handle = await h.start(task_text="t", script=script(("seat-1", 1, calls)))
        state = await h.wait_for(handle, lambda s: bool(s.pending_approvals))
        (approval_id,) = state.pending_approvals
        greedy = ExtendInput(
            approval_id=approval_id,
            seconds=3600,
            extended_by="ops",
            max_seconds=10**9,
            max_extensions=10**6,
            max_total_seconds=10**9,
        )
        refused = 0
        for _ in range(5):
            try:
                await handle.execute_update(
                    RoundtableWorkflow.extend_approval, greedy, result_type=ExtendOutput
                )
            except WorkflowUpdateFailedError:
                refused += 1
        assert refused == 2  # the worker's limit of 3 held
        events = await h.store.list_events(handle.id)
        by = [e["payload"]["by"] for e in events if e["event_type"] == "approval.extended"]
        assert by == ["unattested:ops"] * 3
