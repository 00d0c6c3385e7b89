"""Nothing a caller or a model sends can push a workflow past Temporal's limits:
requests over a bound are refused at the door naming the field; what a model
says is bounded before it enters history."""

from __future__ import annotations

import pytest

from roundtable.agents.tool_calls import MAX_TOOL_CALLS_PER_TURN, sanitize_tool_calls
from roundtable.context_budget import ELIDED_PREFIX, fit_context
from roundtable.models import ChatMessage, ToolCall
from roundtable.security import REDACTED, redact_text
from tests.api_server import serve_api
from tests.workflow_harness import harness, ticket_call

TOO_MANY_CALLS = {
    "turns": [{"seat": "seat-1", "round": 1, "tool_calls": [ticket_call("ticket_get")] * 17}]
}
HUGE_SCRIPT = {"turns": [{"seat": "seat-1", "round": r, "text": "z" * 19_000} for r in range(1, 9)]}


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"seats": [f"s{i}" for i in range(13)]}, "seats"),
        ({"tools": [f"tool-{i}" for i in range(65)]}, "tools"),
        ({"model": "m" * 200}, "model"),
        ({"manager": "not a seat id!"}, "manager"),
        ({"seat_roles": {"seat-1": "r" * 4_001}}, "seat_roles.seat-1"),
        ({"script": TOO_MANY_CALLS}, "script.turns.0.tool_calls"),
        ({"script": HUGE_SCRIPT}, "script"),
        ({"task_text": "t" * 20_001}, "task_text"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
async def test_requests_over_a_bound_are_422_naming_the_field(
    tmp_path, body: dict, field: str
) -> None:
    async with harness(tmp_path) as h, serve_api(h) as api:
        response = await api.http.post(
            "/v1/runs", headers=api.auth("alice"), json={"task_text": "t", **body}
        )
        assert response.status_code == 422, response.text
        assert field in [e["field"] for e in response.json()["errors"]], response.json()
        listed = await api.http.get("/v1/runs", headers=api.auth("alice"))
        assert listed.json()["items"] == []  # nothing was started


async def test_a_user_id_over_its_bound_is_422(tmp_path) -> None:
    async with harness(tmp_path) as h, serve_api(h) as api:
        response = await api.http.post(
            "/v1/runs", headers=api.auth("svc"), json={"task_text": "t", "user_id": "u" * 256}
        )
        assert response.status_code == 422
        assert response.json()["errors"][0]["field"] == "user_id"


def test_a_models_tool_calls_get_their_own_ids_and_bounds() -> None:
    big = ToolCall(id="big", name="ticket_update", arguments={"blob": "x" * 70_000})
    calls = [big] + [ToolCall(id="same", name="ticket_get", arguments={"n": i}) for i in range(20)]
    checked = sanitize_tool_calls(calls)
    assert len({c.id for c in checked}) == len(checked) == 21
    assert [c.id for c in checked[1:4]] == ["same", "same#2", "same#3"]
    assert "larger than" in checked[0].malformed and checked[0].arguments == {}
    assert all(c.malformed is None for c in checked[1:MAX_TOOL_CALLS_PER_TURN])
    assert all("too many tool calls" in (c.malformed or "") for c in checked[16:])


def test_error_messages_lose_every_argument_value() -> None:
    arguments = {"ticket_id": "T-1", "body": "the customer's card 4242", "nested": {"k": "s3cr3t!"}}
    said = redact_text(
        "rejected body 'the customer's card 4242' with s3cr3t! for T-1", arguments, ["ticket_id"]
    )
    assert "4242" not in said and "s3cr3t!" not in said
    assert REDACTED in said and "T-1" in said  # a safe field stays readable
    assert len(redact_text("e" * 5_000, {})) <= 501


def test_the_context_budget_elides_the_oldest_first() -> None:
    system = ChatMessage(role="system", content="you are seat-1")
    old = ChatMessage(role="tool", content="a" * 600)
    new = ChatMessage(role="tool", content="b" * 600)
    threads = {"seat-1": [system, old, new]}
    transcript = [ChatMessage(role="user", name="seat-2", content="c" * 100)]
    assert fit_context(threads, transcript, budget=2_000) == 0
    assert fit_context(threads, transcript, budget=1_000) == 1
    kept = threads["seat-1"]
    assert kept[0] == system and kept[2] == new
    assert kept[1].content.startswith(ELIDED_PREFIX) and "600 bytes" in kept[1].content
