"""NUL bytes and lone surrogates, which PostgreSQL cannot store: refused from
callers (InvalidInputError, 422 naming the field), escaped from models and
tools (the run goes on). The same on SQLite and PostgreSQL."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest

from roundtable.store import InvalidInputError, Store
from tests.api_server import serve_api
from tests.helpers import new_action, new_run, target_for
from tests.test_api import finished, pending_approval
from tests.workflow_harness import harness, script

BAD = ["a\x00b", "a\ud800b"]


@pytest.mark.parametrize("bad", BAD, ids=["nul", "surrogate"])
async def test_caller_text_that_the_database_cannot_store_is_invalid_input(
    store: Store, bad: str
) -> None:
    with pytest.raises(InvalidInputError) as refused:
        await store.create_session(user_id="u1", task_text=bad)
    assert refused.value.field == "task_text"
    with pytest.raises(InvalidInputError) as refused:
        await store.create_session(user_id=bad, task_text="t")
    assert refused.value.field == "user_id"
    run = await new_run(store)
    action = await new_action(
        store,
        run,
        key="k",
        target_key=target_for(),
        status="waiting_approval",
        approval_expires_at=datetime.now(UTC) + timedelta(hours=1),
    )
    with pytest.raises(InvalidInputError) as refused:
        await store.decide_approval(action["approval_id"], "approved", "alice", reason=bad)
    assert refused.value.field == "reason"
    with pytest.raises(InvalidInputError):
        await store.extend_approval(action["approval_id"], 60, bad, 3600)
    # Lookups by an id nobody could have been given: bad input, not a database error.
    for lookup in (store.get_run, store.get_approval, store.get_action):
        with pytest.raises(InvalidInputError):
            await lookup(bad)
    with pytest.raises(InvalidInputError):
        await store.list_runs(user_id=bad)
    assert (await store.get_approval(action["approval_id"]))["status"] == "pending"


async def test_model_and_tool_text_is_escaped_and_the_audit_chain_holds(store: Store) -> None:
    run = await new_run(store)
    nasty = "x\x00y\ud800z"
    action = await new_action(
        store,
        run,
        key="k",
        target_key=target_for(),
        arguments={"title": nasty, nasty: [nasty]},
        safe_argument_fields=["title", nasty],
    )
    kept = await store.get_action(action["id"])
    assert kept["arguments"]["title"] == "x\\u0000y\\ud800z"
    assert kept["arguments"]["x\\u0000y\\ud800z"] == ["x\\u0000y\\ud800z"]
    await store.record_turn(
        run["id"], seat=nasty, round_number=1, model=nasty, prompt_tokens=1, completion_tokens=2
    )
    await store.set_run_status(run["id"], "running")
    await store.set_run_status(run["id"], "failed", {"code": "model_error", "message": nasty})
    failed = await store.get_run(run["id"])
    assert failed["failure"]["message"] == "x\\u0000y\\ud800z"
    events = await store.list_events(run["id"])
    turn = next(e for e in events if e["event_type"] == "turn.completed")
    assert turn["payload"]["model"] == "x\\u0000y\\ud800z"
    assert await store.verify_audit_chain(run["id"])
    ref = await store.save_tool_result(run_id=run["id"], seat=nasty, call_id=nasty, content=nasty)
    assert (await store.get_tool_result(ref))["content"] == nasty  # encrypted: kept exactly
    # Nothing stored carries a raw NUL or surrogate any more.
    for text in (json.dumps(kept, default=str), json.dumps(events, default=str)):
        assert "\\u0000" not in text.replace("\\\\u0000", "")


@pytest.fixture(params=["sqlite", "postgresql"])
def api_database(request: pytest.FixtureRequest, tmp_path) -> str:  # type: ignore[no-untyped-def]
    if request.param == "sqlite":
        return f"sqlite+aiosqlite:///{tmp_path / 'api.db'}"
    return request.getfixturevalue("postgres_url")


async def test_api_refuses_nul_and_surrogates_from_callers_naming_the_field(
    tmp_path, api_database: str
) -> None:
    async with harness(tmp_path, database_url=api_database) as h, serve_api(h) as api:
        headers = {**api.auth("alice"), "Content-Type": "application/json"}
        for bad in BAD:
            # ensure_ascii: a lone surrogate travels as the JSON escape \\ud800.
            body = json.dumps({"task_text": bad}).encode()
            answer = await api.http.post("/v1/runs", content=body, headers=headers)
            assert answer.status_code == 422, answer.text
            assert answer.headers["content-type"] == "application/problem+json"
            assert "task_text" in [e["field"] for e in answer.json()["errors"]]
        lookup = await api.http.get("/v1/runs/run-%00", headers=api.auth("alice"))
        assert lookup.status_code in (404, 422), lookup.text
        assert (await api.http.get("/v1/runs", headers=api.auth("alice"))).json()["items"] == []

        # Pydantic already refuses lone surrogates in request JSON; NUL passes
        # the door and plays the model's (the script's) and the tool's text.
        nasty = "x\x00y"
        calls = [
            {
                "name": "ticket_comment",
                "args": {"tenant_id": "acme", "ticket_id": "T-1", "body": nasty},
            }
        ]
        turns = script(("seat-1", 1, calls), final=nasty)
        turns["turns"][0]["text"] = nasty
        started = await api.http.post(
            "/v1/runs",
            content=json.dumps({"task_text": "t", "script": turns}).encode(),
            headers=headers,
        )
        assert started.status_code == 201, started.text
        run_id = started.json()["run_id"]
        approval = await pending_approval(api, run_id)
        refused = await api.http.post(
            f"/v1/approvals/{approval['id']}/decision",
            content=json.dumps(
                {
                    "decision": "approved",
                    "reason": "ok\ud800",
                    "arguments_digest": approval["arguments_digest"],
                }
            ).encode(),
            headers=headers,
        )
        assert refused.status_code == 422, refused.text
        assert "reason" in [e["field"] for e in refused.json()["errors"]]
        approved = await api.http.post(
            f"/v1/approvals/{approval['id']}/decision",
            json={"decision": "approved", "arguments_digest": approval["arguments_digest"]},
            headers=api.auth("alice"),
        )
        assert approved.status_code == 200, approved.text
        run = await finished(api, run_id)
        assert run["status"] == "completed", run
        assert await h.store.verify_audit_chain(run_id)
        events = await api.http.get(f"/v1/runs/{run_id}/events", headers=api.auth("alice"))
        assert events.status_code == 200
