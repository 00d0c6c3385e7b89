"""Seats on an OpenAI-compatible endpoint (a local fake speaking the wire format)."""

from __future__ import annotations

import asyncio
import gc
import json
import logging

import pytest

from roundtable.agents.base import resolve_model
from roundtable.models import ChatMessage, Decision, TurnRequest
from tests.api_server import serve_api
from tests.fake_openai import error, fake_openai, message
from tests.workflow_harness import harness
from workflows.roundtable import RoundtableWorkflow

UPDATE_T1 = {"tenant_id": "acme", "ticket_id": "T-1", "fields": {"priority": "high"}}


def role_of(body: dict) -> str:
    system = body["messages"][0]["content"]
    if system.startswith("You chair"):
        return "manager"
    return system.split(",", 1)[0].removeprefix("You are ")


@pytest.fixture
def endpoint(monkeypatch):  # type: ignore[no-untyped-def]
    def use(fake):  # type: ignore[no-untyped-def]
        monkeypatch.setenv("OPENAI_BASE_URL", fake.base_url)
        monkeypatch.setenv("OPENAI_API_KEY", "sk-test-not-real")

    return use


async def test_two_seats_on_a_model_endpoint_through_approval(tmp_path, endpoint) -> None:
    def replies(body: dict, _n: int) -> dict:
        who = role_of(body)
        if who == "manager":
            return message("Final: T-1 is now high priority.", usage=(50, 10))
        if who == "seat-1":
            return message("Raising it.", [("ticket_update", UPDATE_T1)])
        return message("Agreed.")

    async with (
        fake_openai(replies) as fake,
        harness(tmp_path) as h,
        serve_api(h, allowed_models=["*"]) as api,
    ):
        endpoint(fake)
        handle = await h.start(
            task_text="triage T-1",
            model="openai:gpt-4o-mini",
            seat_roles={"seat-1": "support engineer"},
            reasoning_effort="low",
        )
        state = await h.wait_for(handle, lambda s: bool(s.pending_approvals))
        (approval_id,) = state.pending_approvals
        await handle.execute_update(
            RoundtableWorkflow.decide_approval,
            Decision(approval_id=approval_id, decision="approved", decided_by="op"),
        )
        result = await handle.result()
        assert (result.status, result.final_answer) == (
            "completed",
            "Final: T-1 is now high priority.",
        )
        assert [w["ticket_id"] for w in await h.tickets.write_log()] == ["T-1"]

        first = fake.for_seat("seat-1")[0]
        assert first["model"] == "gpt-4o-mini" and first["reasoning_effort"] == "low"
        assert "support engineer" in first["messages"][0]["content"]
        tools = {t["function"]["name"]: t["function"] for t in first["tools"]}
        assert "ticket_update" in tools
        assert "fields" in tools["ticket_update"]["parameters"]["properties"]
        assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (72, 24)

        view = (await api.http.get(f"/v1/runs/{handle.id}", headers=api.auth("ops"))).json()
        assert view["usage"] == {"turns": 3, "prompt_tokens": 72, "completion_tokens": 24}


async def test_malformed_model_output_is_told_to_the_seat_never_run(tmp_path, endpoint) -> None:
    def replies(body: dict, _n: int) -> dict:
        who = role_of(body)
        if who == "seat-1" and not any(m["role"] == "tool" for m in body["messages"]):
            return message(
                "Trying things.",
                [
                    ("ticket_update", "{not json"),
                    ("ticket_purge", {}),
                    ("ticket_close", {"tenant_id": "acme", "ticket_id": "T-1"}),
                ],
            )
        return message("Nothing more.")

    async with fake_openai(replies) as fake, harness(tmp_path) as h:
        endpoint(fake)
        handle = await h.start(
            task_text="t",
            model="openai:m",
            max_rounds=2,
            seat_tools={"seat-1": ["ticket_get", "ticket_update"]},
        )
        assert (await handle.result()).status == "completed"
        assert await h.store.list_actions(handle.id) == []

        second = fake.for_seat("seat-1")[1]  # round 2 carries round 1's tool results
        calls = {
            c["id"]: c["function"]["name"]
            for m in second["messages"]
            if m["role"] == "assistant" and m.get("tool_calls")
            for c in m["tool_calls"]
        }
        told = {
            calls[m["tool_call_id"]]: json.loads(m["content"])
            for m in second["messages"]
            if m["role"] == "tool"
        }
        assert told["ticket_update"]["result"]["error_code"] == "malformed_call"
        assert told["ticket_purge"]["result"]["error_code"] == "unknown_tool"
        assert told["ticket_close"]["result"]["error_code"] == "tool_not_granted"
        seat1_tools = {t["function"]["name"] for t in fake.for_seat("seat-1")[0]["tools"]}
        assert seat1_tools == {"ticket_get", "ticket_update"}


async def test_rate_limits_and_slow_answers_are_retried(tmp_path, endpoint, monkeypatch) -> None:
    monkeypatch.setenv("ROUNDTABLE_OPENAI_TIMEOUT_SECONDS", "1")

    def replies(_body: dict, n: int) -> dict:
        if n == 1:
            return error(429)
        if n == 2:
            return {**message("late"), "delay": 3}  # longer than the timeout
        return message("fine")

    async with fake_openai(replies) as fake, harness(tmp_path) as h:
        endpoint(fake)
        handle = await h.start(task_text="t", model="openai:m", seats=["seat-1"], manager=None)
        result = await handle.result()
        assert (result.status, result.final_answer) == ("completed", "fine")
        assert len(fake.requests) == 3


async def test_a_refused_request_fails_the_run_cleanly(tmp_path, endpoint) -> None:
    async with fake_openai(lambda _b, _n: error(401)) as fake, harness(tmp_path) as h:
        endpoint(fake)
        handle = await h.start(task_text="t", model="openai:m", seats=["seat-1"])
        with pytest.raises(Exception, match="failed"):
            await handle.result()
        assert len(fake.requests) == 1  # final: not retried
        assert (await h.store.get_run(handle.id))["status"] == "failed"


def test_a_turn_leaves_no_client_open_for_a_later_event_loop(monkeypatch, caplog) -> None:
    """Each turn resolves its model afresh, with a client of its own. Left
    open, the client was closed by the garbage collector on whichever event
    loop ran next, whose task then failed on the first loop's closed
    transport, a traceback in that loop's logs (a CI run caught one in
    another test's output). The turn's own client is closed with the turn."""
    request = TurnRequest(
        run_id="run-1",
        seat="seat-1",
        round=1,
        role="seat",
        model="openai:m",
        messages=[ChatMessage(role="user", content="hello")],
    )

    async def turns() -> list[str]:
        async with fake_openai(lambda _body, _n: message("done")) as fake:
            monkeypatch.setenv("OPENAI_BASE_URL", fake.base_url)
            monkeypatch.setenv("OPENAI_API_KEY", "sk-test-not-real")
            return [(await resolve_model("openai:m").respond(request)).text for _ in range(3)]

    assert asyncio.run(turns()) == ["done"] * 3

    async def later() -> None:
        gc.collect()
        await asyncio.sleep(0.1)

    with caplog.at_level(logging.WARNING, logger="asyncio"):
        asyncio.run(later())
    assert [r.getMessage() for r in caplog.records if r.name == "asyncio"] == []
