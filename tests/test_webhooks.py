"""Outgoing webhooks to a real HTTP receiver: signed, retried, logged."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from temporalio.api.enums.v1 import EventType

from roundtable.models import ReconcileInput
from roundtable.webhooks import SIGNATURE_HEADER, signing_key, verify_signature
from tests.api_server import serve_api, serving
from tests.test_replay_clock import LOCAL_ACTIVITY_MARKER
from tests.workflow_harness import as_operator, harness, script, ticket_call
from worker import WebhookConfig, build_worker
from workflows.roundtable import RoundtableWorkflow

KEY = signing_key("webhook-test-secret")


@dataclass
class Receiver:
    url: str
    answers: list[int]  # status codes to answer with, in order; then 200
    received: list[dict] = field(default_factory=list)

    def events(self, delivered_only: bool = True) -> list[str]:
        return [r["event_type"] for r in self.received if r["status"] == 200 or not delivered_only]


@asynccontextmanager
async def receiver(answers: list[int] | None = None) -> AsyncIterator[Receiver]:
    made = Receiver("", list(answers or []))

    async def hook(request: Request) -> JSONResponse:
        body = await request.body()
        status = made.answers.pop(0) if made.answers else 200
        made.received.append(
            {
                "event_type": request.headers["x-roundtable-event"],
                "delivery": request.headers["x-roundtable-delivery"],
                "signed": verify_signature(KEY, body, request.headers[SIGNATURE_HEADER]),
                "body": json.loads(body),
                "status": status,
            }
        )
        return JSONResponse({"ok": status == 200}, status_code=status)

    async with serving(Starlette(routes=[Route("/hook", hook, methods=["POST"])])) as port:
        made.url = f"http://127.0.0.1:{port}/hook"
        yield made


def with_webhooks(*urls: str, lead: int = 300):  # type: ignore[no-untyped-def]
    def factory(client, queue, store, registry, **options):  # type: ignore[no-untyped-def]
        return build_worker(
            client,
            queue,
            store,
            registry,
            WebhookConfig(list(urls), KEY, expiring_lead_seconds=lead),
            **options,
        )

    return factory


async def test_approval_lifecycle_webhooks_are_signed_retried_and_logged(tmp_path) -> None:
    async with (
        receiver(answers=[500]) as hook,
        harness(tmp_path, worker_factory=with_webhooks(hook.url, lead=300)) as h,
    ):
        handle = await h.start(
            task_text="t",
            approval_timeout_seconds=3600,
            script=script(("seat-1", 1, [ticket_call("ticket_update")])),
        )
        await h.wait_for(handle, lambda s: bool(s.pending_approvals))
        assert (await handle.result()).status == "completed"  # skips to warning and expiry

        assert hook.events() == ["approval.requested", "approval.expiring", "run.completed"]
        assert all(r["signed"] for r in hook.received)
        first, retried = hook.received[0], hook.received[1]
        assert (first["status"], retried["status"]) == (500, 200)
        assert first["delivery"] == retried["delivery"]  # stable: receivers de-duplicate
        requested = retried["body"]
        assert requested["run_id"] == handle.id
        assert requested["data"]["tool_name"] == "ticket_update"
        assert "arguments" not in json.dumps(requested)

        log = await h.store.list_webhook_deliveries(run_id=handle.id)
        attempts = [(d["event_type"], d["attempt"], d["status_code"], d["delivered"]) for d in log]
        assert attempts[:2] == [
            ("approval.requested", 1, 500, False),
            ("approval.requested", 2, 200, True),
        ]
        assert ("run.completed", 1, 200, True) in attempts

        async with serve_api(h) as api:
            listed = await api.http.get(
                "/v1/webhook-deliveries", params={"run_id": handle.id}, headers=api.auth("ops")
            )
            assert listed.status_code == 200
            assert [d["status_code"] for d in listed.json()["items"]][:2] == [500, 200]
            assert (
                await api.http.get("/v1/webhook-deliveries", headers=api.auth("alice"))
            ).status_code == 403


async def test_a_past_warning_goes_out_in_a_later_task_after_a_timer(tmp_path) -> None:
    """A lead longer than the approval: the warning's time has passed before
    the approval is even asked for. It is sent after a timer fires (of a
    millisecond), in a later task, not in the task that asks for the approval
    on the clock's say (tests/test_replay_clock.py); and the approval still
    expires at its own deadline, not the warning's. Read from the history:
    the order two concurrent deliveries reach the receiver tells nothing
    (the review found the first form of this test passing 7 times in 10 with
    the fix reverted)."""
    async with (
        receiver() as hook,
        harness(tmp_path, worker_factory=with_webhooks(hook.url, lead=300)) as h,
    ):
        handle = await h.start(
            task_text="t",
            approval_timeout_seconds=60,
            script=script(("seat-1", 1, [ticket_call("ticket_update")])),
        )
        state = await h.wait_for(handle, lambda s: bool(s.pending_approvals))
        (approval_id,) = state.pending_approvals
        assert (await h.result(handle)).status == "completed"
        assert sorted(hook.events()) == sorted(
            ["approval.requested", "approval.expiring", "run.completed"]
        )

        events = [e async for e in handle.fetch_history_events()]
        webhooks = [
            i
            for i, e in enumerate(events)
            if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
            and e.activity_task_scheduled_event_attributes.activity_type.name == "deliver_webhook"
        ]
        requested, warned = webhooks[0], webhooks[1]
        between = {e.event_type for e in events[requested:warned]}
        assert EventType.EVENT_TYPE_TIMER_FIRED in between
        assert EventType.EVENT_TYPE_WORKFLOW_TASK_STARTED in between

        approval = await h.store.get_approval(approval_id)
        assert approval["status"] == "expired"
        last_started = None
        for event in events:
            if event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_STARTED:
                last_started = event.event_time.ToDatetime(tzinfo=UTC)
            marker = event.marker_recorded_event_attributes
            if (
                event.event_type == EventType.EVENT_TYPE_MARKER_RECORDED
                and marker.marker_name == LOCAL_ACTIVITY_MARKER
                and b"expire_approval" in marker.details["data"].payloads[0].data
            ):
                assert last_started is not None
                assert last_started >= approval["expires_at"]
                break
        else:
            raise AssertionError("no expiry in the history")


async def test_unknown_action_webhook_and_a_receiver_that_refuses(tmp_path) -> None:
    def drops_after_write(registry, _tickets):  # type: ignore[no-untyped-def]
        original = registry.tools["ticket_update"]

        async def handler(args, ctx):  # type: ignore[no-untyped-def]
            await original.handler(args, ctx)
            raise ConnectionResetError("gone")

        registry.tools["ticket_update"] = dataclasses.replace(original, handler=handler)

    async with (
        receiver() as good,
        receiver(answers=[400] * 10) as refusing,
        harness(
            tmp_path,
            customize=drops_after_write,
            worker_factory=with_webhooks(good.url, refusing.url),
        ) as h,
    ):
        handle = await h.start(
            task_text="t",
            write_policy="auto_approve_up_to:R3",
            script=script(("seat-1", 1, [ticket_call("ticket_update")])),
        )
        state = await h.wait_for(handle, lambda s: bool(s.unknown_actions))
        (action_id,) = state.unknown_actions
        for _ in range(100):
            if "action.unknown" in good.events():
                break
            await asyncio.sleep(0.05)
        assert good.received[0]["body"]["data"]["action_id"] == action_id
        await handle.execute_update(
            RoundtableWorkflow.reconcile_action,
            as_operator(
                ReconcileInput(
                    action_id=action_id,
                    outcome="succeeded",
                    decided_by="op",
                    note="ok",
                    request_id="op-1",
                )
            ),
        )
        assert (await handle.result()).status == "completed"
        assert good.events() == ["action.unknown", "run.completed"]
        # A 4xx is permanent: one attempt per event, and the run did not wait on it.
        assert [r["status"] for r in refusing.received] == [400, 400]


def test_signatures_verify_and_refuse_tampering_and_replays() -> None:
    import time

    from roundtable.webhooks import sign

    body = b'{"event_type":"run.completed"}'
    header = sign(KEY, body)
    assert verify_signature(KEY, body, header)
    assert not verify_signature(KEY, body + b" ", header)
    assert not verify_signature(signing_key("another secret"), body, header)
    stale = sign(KEY, body, int(time.time()) - 3600)
    assert not verify_signature(KEY, body, stale)
    assert not verify_signature(KEY, body, "garbage")


async def test_a_secret_in_a_webhook_url_is_never_written_down(tmp_path) -> None:
    """Webhook URLs often carry their own secret; it once appeared in the
    delivery log and in failure messages in Temporal's history."""
    async with receiver(answers=[500]) as hook:
        secret_url = f"{hook.url}?token=SEKRET-in-query"
        unreachable = "http://127.0.0.1:9/hooks/SEKRET-in-path"
        async with harness(tmp_path, worker_factory=with_webhooks(secret_url, unreachable)) as h:
            handle = await h.start(task_text="t", script=script(("seat-1", 1, [])))
            await handle.result()
            log = await h.store.list_webhook_deliveries(run_id=handle.id)
            assert {d["delivered"] for d in log} == {True, False}
            assert "SEKRET" not in json.dumps(log, default=str)
            assert all(d["url"].startswith("http://127.0.0.1:") for d in log)
            messages, inputs = [], []
            async for event in handle.fetch_history_events():
                if event.HasField("activity_task_failed_event_attributes"):
                    failure = event.activity_task_failed_event_attributes.failure
                    error = await h.client.data_converter.decode_failure(failure)
                    messages.append(str(error))
                for field in ("activity_task_scheduled", "activity_task_completed"):
                    if event.HasField(f"{field}_event_attributes"):
                        attributes = getattr(event, f"{field}_event_attributes")
                        payloads = getattr(attributes, "input", None) or attributes.result
                        decoded = await h.client.data_converter.payload_codec.decode(
                            list(payloads.payloads)
                        )
                        inputs.append(b"".join(p.data for p in decoded))
            assert messages and not any("SEKRET" in m for m in messages), messages
            # Decoded, the history names receivers by label: never the URL.
            assert inputs and not any(b"SEKRET" in i for i in inputs)
            assert "SEKRET" not in repr(await h.state(handle))


async def test_a_worker_calls_only_the_receivers_it_was_configured_with(tmp_path) -> None:
    """A delivery naming any other URL (a forged workflow, say) is refused
    before a request is made."""
    from datetime import UTC, datetime

    import pytest
    from temporalio.exceptions import ApplicationError
    from temporalio.testing import ActivityEnvironment

    from activities.webhook_activities import WebhookActivities
    from roundtable.models import WebhookDelivery, WebhookEvent
    from roundtable.store import open_store

    async with open_store(f"sqlite+aiosqlite:///{tmp_path / 'rt.db'}") as store:
        hooks = WebhookActivities(store, KEY, urls=["http://127.0.0.1:9/configured"])
        event = WebhookEvent(
            event_id="e-1",
            event_type="run.completed",
            run_id="run-1",
            occurred_at=datetime.now(UTC),
            data={},
        )
        forged = WebhookDelivery(event=event, url="http://169.254.169.254/latest/meta-data")
        with pytest.raises(ApplicationError, match="not a receiver"):
            await ActivityEnvironment().run(hooks.deliver_webhook, forged)
        assert await store.list_webhook_deliveries() == []
