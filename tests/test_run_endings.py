"""Runs that once wedged or orphaned: a failing or cancelled parallel run,
results far over Temporal's payload limit, usage counted twice."""

from __future__ import annotations

import asyncio
import json

import pytest
from temporalio import activity
from temporalio.client import WorkflowFailureError

from activities.run_activities import RunActivities
from roundtable.models import TakeTurnInput, TakeTurnOutput
from roundtable.tools.registry import ToolDefinition, ToolRegistry
from roundtable.tools.tickets import TicketRef
from roundtable.views import run_view
from tests.fake_openai import error, fake_openai, message
from tests.test_openai_adapter import role_of
from tests.workflow_harness import Harness, harness, script, ticket_call

# seat-2 updates T-1 (R2: runs at once, slowly) and closes T-2 (R3: needs a person).
SEAT_2_WRITES = script(
    ("seat-2", 1, [ticket_call("ticket_update", "T-1"), ticket_call("ticket_close", "T-2")])
)
POLICY = "auto_approve_up_to:R2"


async def write_started(h: Harness) -> None:
    for _ in range(500):
        if await h.tickets.write_log():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the update never started")


async def write_started_and_close_waiting(h: Harness) -> None:
    """seat-2's update under way and its close waiting for a person, read
    from the store (the test's only run)."""
    await write_started(h)
    for _ in range(500):
        if await h.store.list_approvals(status="pending"):
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the close never waited for approval")


async def write_in_flight_and_approval_pending(h: Harness, handle) -> None:  # type: ignore[no-untyped-def]
    await h.wait_for(handle, lambda s: bool(s.pending_approvals))
    await write_started(h)


async def assert_every_write_settled(h: Harness, run_id: str) -> None:
    by_tool = {a["tool_name"]: a for a in await h.store.list_actions(run_id)}
    assert by_tool["ticket_update"]["status"] == "succeeded"  # it ran to its end
    assert by_tool["ticket_close"]["status"] == "rejected"
    assert by_tool["ticket_close"]["result"] == {"error_code": "run_ended"}
    (approval,) = await h.store.list_approvals(run_id=run_id)
    assert approval["status"] == "withdrawn"
    assert [w["outcome"] for w in await h.tickets.write_log()] == ["applied"]
    assert await h.store.verify_audit_chain(run_id)


async def test_a_parallel_run_whose_seat_fails_settles_the_other_seats_writes(
    tmp_path, monkeypatch
) -> None:
    started: list[Harness] = []

    def replies(body: dict, _n: int) -> dict:
        # seat-1's model refuses once seat-2's update is under way and its
        # close waits for approval (a fixed delay raced seat-2's turn on a
        # loaded machine)
        return {**error(401), "after": lambda: write_started_and_close_waiting(started[0])}

    async with fake_openai(replies) as fake, harness(tmp_path, write_delay=3.0) as h:
        started.append(h)
        monkeypatch.setenv("OPENAI_BASE_URL", fake.base_url)
        monkeypatch.setenv("OPENAI_API_KEY", "sk-test-not-real")
        handle = await h.start(
            task_text="t",
            mode="parallel",
            script=SEAT_2_WRITES,
            seat_models={"seat-1": "openai:refuses"},
            write_policy=POLICY,
        )
        with pytest.raises(WorkflowFailureError):
            await handle.result()
        await assert_every_write_settled(h, handle.id)
        run = await h.store.get_run(handle.id)
        assert run["status"] == "failed"
        assert run["failure"]["code"] == "ModelRequestRejected"
        assert "take_turn" in run["failure"]["message"]


async def test_a_cancelled_run_settles_every_write_before_it_ends(tmp_path) -> None:
    async with harness(tmp_path, write_delay=3.0) as h:
        handle = await h.start(
            task_text="t", mode="parallel", script=SEAT_2_WRITES, write_policy=POLICY
        )
        await write_in_flight_and_approval_pending(h, handle)
        await handle.cancel()
        with pytest.raises(WorkflowFailureError):
            await handle.result()
        await assert_every_write_settled(h, handle.id)
        assert (await h.store.get_run(handle.id))["status"] == "cancelled"


def big_reads(registry: ToolRegistry, _tickets) -> None:  # type: ignore[no-untyped-def]
    async def read(args: TicketRef, ctx) -> dict:  # type: ignore[no-untyped-def]
        return {"ticket_id": args.ticket_id, "attachment": "x" * 1_100_000}

    registry.register(
        ToolDefinition(
            name="ticket_attachment",
            description="Read a ticket's attachment.",
            side_effect="read",
            risk_level="R0",
            handler=read,
            args_model=TicketRef,
        )
    )


async def test_results_far_over_the_payload_limit_are_passed_by_reference(tmp_path) -> None:
    """Two 1.1 MB reads in round 1 once made round 2's turn input 2.2 MB, over
    Temporal's 2 MiB limit: every workflow task failed for ever, silently."""
    read = {"name": "ticket_attachment", "args": {"tenant_id": "acme", "ticket_id": "T-1"}}
    rounds = script(
        ("seat-1", 1, [read, {**read, "id": "second"}]),
        ("seat-1", 2, [read]),
        ("seat-2", 2, [read]),
    )
    async with harness(tmp_path, customize=big_reads) as h:
        handle = await h.start(task_text="t", script=rounds, max_rounds=3)
        assert (await handle.result()).status == "completed"
        state = await h.state(handle)
        told = [json.loads(m.content) for m in state.threads["seat-1"] if m.role == "tool"]
        assert len(told) == 3
        for outcome in told:
            result = outcome["result"]
            assert result["truncated"] is True and result["size_bytes"] > 1_100_000
            assert len(result["preview"]) <= 2_000
            kept = await h.store.get_tool_result(result["result_ref"])
            assert kept["content"]["attachment"] == "x" * 1_100_000
        size = len(state.model_dump_json())
        assert size < 1_000_000, size


async def test_model_text_far_over_the_limit_is_kept_by_reference(tmp_path, monkeypatch) -> None:
    def replies(body: dict, _n: int) -> dict:
        return message("y" * 1_500_000) if role_of(body) == "seat-1" else message("ok")

    async with fake_openai(replies) as fake, harness(tmp_path) as h:
        monkeypatch.setenv("OPENAI_BASE_URL", fake.base_url)
        monkeypatch.setenv("OPENAI_API_KEY", "sk-test-not-real")
        handle = await h.start(task_text="t", model="openai:verbose", max_rounds=2)
        assert (await handle.result()).status == "completed"
        said = [m.content for m in (await h.state(handle)).transcript if m.name == "seat-1"]
        assert len(said) == 2 and all("[truncated: the full text" in s for s in said)
        ref = said[0].rsplit("kept as ", 1)[1].rstrip("]")
        assert (await h.store.get_tool_result(ref))["content"] == "y" * 1_500_000


async def test_a_retried_turn_counts_its_usage_once(tmp_path, monkeypatch) -> None:
    original = RunActivities.take_turn

    @activity.defn(name="take_turn")
    async def loses_its_first_answer(self, inp: TakeTurnInput) -> TakeTurnOutput:  # type: ignore[no-untyped-def]
        answer = await original(self, inp)
        if activity.info().attempt == 1:
            raise ConnectionResetError("the answer was lost on its way back")
        return answer

    monkeypatch.setattr(RunActivities, "take_turn", loses_its_first_answer)

    def replies(body: dict, _n: int) -> dict:
        return message("noted", usage=(100, 20))

    async with fake_openai(replies) as fake, harness(tmp_path) as h:
        monkeypatch.setenv("OPENAI_BASE_URL", fake.base_url)
        monkeypatch.setenv("OPENAI_API_KEY", "sk-test-not-real")
        handle = await h.start(
            task_text="t", model="openai:m", seats=["seat-1"], manager=None, max_rounds=2
        )
        result = await handle.result()
        # The lost answer was kept (the turn journal): its retry is not asked again.
        assert len(fake.requests) == 2
        view = await run_view(h.store, handle.id)
        assert view["usage"] == {"turns": 2, "prompt_tokens": 200, "completion_tokens": 40}
        assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (200, 40)
