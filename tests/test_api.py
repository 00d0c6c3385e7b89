"""The HTTP API over real HTTP, against a real worker on the time-skipping server."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from api.app import create_app
from roundtable.config import Settings
from tests.api_server import Api, serve_api, serving
from tests.workflow_harness import harness, script, ticket_call

ONE_WRITE = script(("seat-1", 1, [ticket_call("ticket_update")]), final="done")


async def start(api: Api, who: str = "alice", **body) -> dict:  # type: ignore[no-untyped-def]
    response = await api.http.post(
        "/v1/runs", json={"task_text": "t", "script": ONE_WRITE, **body}, headers=api.auth(who)
    )
    assert response.status_code == 201, response.text
    return response.json()


async def pending_approval(api: Api, run_id: str, who: str = "alice") -> dict:
    for _ in range(200):
        listed = (await api.http.get(f"/v1/runs/{run_id}/approvals", headers=api.auth(who))).json()
        if listed and listed[0]["status"] == "pending":
            return listed[0]
        await asyncio.sleep(0.05)
    raise AssertionError("no pending approval")


async def finished(api: Api, run_id: str, who: str = "alice") -> dict:
    for _ in range(300):
        run = (await api.http.get(f"/v1/runs/{run_id}", headers=api.auth(who))).json()
        if run["status"] in ("completed", "failed"):
            return run
        await asyncio.sleep(0.05)
    raise AssertionError("run did not finish")


async def test_full_approve_path(tmp_path) -> None:
    async with harness(tmp_path) as h, serve_api(h) as api:
        started = await start(api)
        assert set(started) == {"run_id", "workflow_id", "status"}
        readable = await api.http.get(f"/v1/runs/{started['run_id']}", headers=api.auth("alice"))
        assert readable.status_code == 200  # readable the moment POST returns

        approval = await pending_approval(api, started["run_id"])
        assert approval["tool_name"] == "ticket_update"
        assert approval["arguments"]["ticket_id"] == "T-1"
        assert approval["arguments_digest"].startswith("sha256:")
        assert {"id", "run_id", "action_id", "status", "expires_at"} <= set(approval)

        wrong = await api.http.post(
            f"/v1/approvals/{approval['id']}/decision",
            headers=api.auth("alice"),
            json={"decision": "approved", "arguments_digest": "sha256:" + "0" * 64},
        )
        assert wrong.status_code == 409 and wrong.json()["code"] == "conflict"
        assert wrong.headers["content-type"] == "application/problem+json"

        decided = await api.http.post(
            f"/v1/approvals/{approval['id']}/decision",
            headers=api.auth("alice"),
            json={
                "decision": "approved",
                "reason": "fine",
                "arguments_digest": approval["arguments_digest"],
            },
        )
        assert decided.status_code == 200, decided.text
        assert decided.json()["status"] == "approved"

        run = await finished(api, started["run_id"])
        assert run["status"] == "completed"
        assert run["actions"][0]["status"] == "succeeded"
        assert run["approvals"][0]["decided_by"] == "alice"  # the token's owner, not a name
        assert len(await h.tickets.write_log()) == 1

        again = await api.http.post(
            f"/v1/approvals/{approval['id']}/decision",
            headers=api.auth("alice"),
            json={"decision": "rejected", "arguments_digest": approval["arguments_digest"]},
        )
        assert again.status_code == 409


async def test_expired_approval_is_409(tmp_path) -> None:
    async with harness(tmp_path) as h, serve_api(h) as api:
        started = await start(api, approval_timeout_seconds=1)
        approval = await pending_approval(api, started["run_id"])
        run = await finished(api, started["run_id"])  # the 1 s workflow timer expires it
        assert run["approvals"][0]["status"] == "expired"
        late = await api.http.post(
            f"/v1/approvals/{approval['id']}/decision",
            headers=api.auth("alice"),
            json={"decision": "approved", "arguments_digest": approval["arguments_digest"]},
        )
        assert late.status_code == 409 and "expired" in late.json()["detail"]


async def test_other_users_runs_are_404_and_roles_are_enforced(tmp_path) -> None:
    async with harness(tmp_path) as h, serve_api(h) as api:
        started = await start(api, who="alice")
        run_id = started["run_id"]
        approval = await pending_approval(api, run_id)
        body = {"decision": "approved", "arguments_digest": approval["arguments_digest"]}
        for path in (
            f"/v1/runs/{run_id}",
            f"/v1/runs/{run_id}/actions",
            f"/v1/runs/{run_id}/approvals",
            f"/v1/runs/{run_id}/events",
            f"/v1/approvals/{approval['id']}",
        ):
            assert (await api.http.get(path, headers=api.auth("bob"))).status_code == 404, path
        refused = await api.http.post(
            f"/v1/approvals/{approval['id']}/decision", headers=api.auth("bob"), json=body
        )
        assert refused.status_code == 404
        assert (await api.http.get("/v1/runs", headers=api.auth("bob"))).json()["items"] == []
        assert (await api.http.get("/v1/approvals", headers=api.auth("bob"))).json()["items"] == []

        service = await api.http.post(
            f"/v1/approvals/{approval['id']}/decision", headers=api.auth("svc"), json=body
        )
        assert service.status_code == 403
        action_id = approval["action_id"]
        user_reconcile = await api.http.post(
            f"/v1/actions/{action_id}/reconcile",
            headers=api.auth("alice"),
            json={"outcome": "failed", "note": "x"},
        )
        assert user_reconcile.status_code == 403
        not_unknown = await api.http.post(
            f"/v1/actions/{action_id}/reconcile",
            headers=api.auth("ops"),
            json={"outcome": "failed", "note": "x"},
        )
        assert not_unknown.status_code == 409

        by_operator = await api.http.post(
            f"/v1/approvals/{approval['id']}/decision", headers=api.auth("ops"), json=body
        )
        assert by_operator.status_code == 200
        run = await finished(api, run_id)
        assert run["approvals"][0]["decided_by"] == "ops"


async def test_service_starts_runs_for_users_and_users_cannot(tmp_path) -> None:
    async with harness(tmp_path) as h, serve_api(h) as api:
        for_alice = await start(api, who="svc", user_id="alice")
        mine = await api.http.get(f"/v1/runs/{for_alice['run_id']}", headers=api.auth("alice"))
        assert mine.status_code == 200 and mine.json()["user_id"] == "alice"
        impersonation = await api.http.post(
            "/v1/runs", headers=api.auth("bob"), json={"task_text": "t", "user_id": "alice"}
        )
        assert impersonation.status_code == 403
        no_user = await api.http.post("/v1/runs", headers=api.auth("svc"), json={"task_text": "t"})
        assert no_user.status_code == 422 and no_user.json()["errors"][0]["field"] == "user_id"


async def test_idempotent_post_returns_the_same_run(tmp_path) -> None:
    async with harness(tmp_path) as h, serve_api(h) as api:
        headers = {**api.auth("alice"), "Idempotency-Key": "order-42"}
        body = {"task_text": "t", "script": ONE_WRITE}
        first = await api.http.post("/v1/runs", json=body, headers=headers)
        second = await api.http.post("/v1/runs", json=body, headers=headers)
        assert first.status_code == second.status_code == 201
        assert first.json()["run_id"] == second.json()["run_id"]
        assert second.headers.get("idempotent-replayed") == "true"
        changed = await api.http.post(
            "/v1/runs", json={**body, "task_text": "other"}, headers=headers
        )
        assert changed.status_code == 409
        # The same key from another user is another run.
        bobs = await api.http.post(
            "/v1/runs", json=body, headers={**api.auth("bob"), "Idempotency-Key": "order-42"}
        )
        assert bobs.json()["run_id"] != first.json()["run_id"]
        assert len((await api.http.get("/v1/runs", headers=api.auth("alice"))).json()["items"]) == 1


async def test_events_stream_live_and_in_order(tmp_path) -> None:
    async with harness(tmp_path) as h, serve_api(h) as api:
        started = await start(api)
        run_id = started["run_id"]
        received: list[dict] = []

        async def follow() -> None:
            headers = {**api.auth("alice"), "Accept": "text/event-stream"}
            async with api.http.stream(
                "GET", f"/v1/runs/{run_id}/events", headers=headers
            ) as stream:
                assert stream.headers["content-type"].startswith("text/event-stream")
                async for line in stream.aiter_lines():
                    if line.startswith("data: "):
                        received.append(json.loads(line[6:]))

        follower = asyncio.create_task(follow())
        approval = await pending_approval(api, run_id)
        for _ in range(100):  # delivered live, while the run still waits
            if any(e["event_type"] == "approval.requested" for e in received):
                break
            await asyncio.sleep(0.05)
        assert any(e["event_type"] == "approval.requested" for e in received)
        assert not follower.done()
        await api.http.post(
            f"/v1/approvals/{approval['id']}/decision",
            headers=api.auth("alice"),
            json={"decision": "approved", "arguments_digest": approval["arguments_digest"]},
        )
        await asyncio.wait_for(follower, 30)  # the stream ends when the run has finished
        seqs = [e["seq"] for e in received]
        assert seqs == list(range(1, len(seqs) + 1))
        types = [e["event_type"] for e in received]
        assert types[0] == "run.created" and "action.succeeded" in types
        assert received[-1]["payload"]["to"] == "completed"
        plain = await api.http.get(f"/v1/runs/{run_id}/events", headers=api.auth("alice"))
        assert [e["seq"] for e in plain.json()["items"]] == seqs


ENDPOINTS = [
    ("GET", "/v1/runs"),
    ("POST", "/v1/runs"),
    ("POST", "/v1/approvals/x/extend"),
    ("GET", "/v1/webhook-deliveries"),
    ("POST", "/codec/encode"),
    ("POST", "/codec/decode"),
    ("GET", "/v1/runs/x"),
    ("GET", "/v1/runs/x/actions"),
    ("GET", "/v1/runs/x/approvals"),
    ("GET", "/v1/runs/x/events"),
    ("GET", "/v1/approvals"),
    ("GET", "/v1/approvals/x"),
    ("POST", "/v1/approvals/x/decision"),
    ("POST", "/v1/actions/x/reconcile"),
]


async def test_every_endpoint_needs_a_valid_token(tmp_path) -> None:
    async with harness(tmp_path) as h, serve_api(h) as api:
        revoked, record = await h.store.create_token(user_id="eve", role="operator")
        await h.store.revoke_token(record["id"])
        for headers in (
            {},
            {"Authorization": "Bearer rt_wrong"},
            {"Authorization": "Basic x"},
            {"Authorization": f"Bearer {revoked}"},
        ):
            for method, path in ENDPOINTS:
                response = await api.http.request(method, path, headers=headers, json={})
                assert response.status_code == 401, (method, path, headers, response.text)
                assert response.json()["code"] == "unauthorized"
                assert response.headers["www-authenticate"] == "Bearer"
        assert (await api.http.get("/healthz")).json() == {"status": "ok"}
        ready = await api.http.get("/readyz")
        assert ready.status_code == 200 and ready.json()["checks"] == {
            "database": "ok",
            "temporal": "ok",
        }


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"task_text": ""}, "task_text"),
        ({"task_text": "t", "max_rounds": 0}, "max_rounds"),
        ({"task_text": "t", "write_policy": "yolo"}, "write_policy"),
        ({"task_text": "t", "seats": ["a b"]}, "seats"),
        ({"task_txt": "t"}, "task_text"),
        ({"task_text": "t", "run_id": "mine"}, "run_id"),
    ],
)
async def test_bad_input_is_a_problem_naming_the_field(tmp_path, body: dict, field: str) -> None:
    async with harness(tmp_path) as h, serve_api(h) as api:
        response = await api.http.post("/v1/runs", json=body, headers=api.auth("alice"))
        assert response.status_code == 422, response.text
        problem = response.json()
        assert problem["code"] == "validation_error"
        assert field in [e["field"] for e in problem["errors"]]
        assert (await api.http.get("/v1/runs", headers=api.auth("alice"))).json()["items"] == []


async def test_malformed_and_oversized_bodies(tmp_path) -> None:
    async with harness(tmp_path) as h, serve_api(h, max_body_bytes=2048) as api:
        headers = {**api.auth("alice"), "Content-Type": "application/json"}
        broken = await api.http.post("/v1/runs", content=b"{not json", headers=headers)
        assert broken.status_code == 422
        huge = await api.http.post("/v1/runs", json={"task_text": "x" * 5000}, headers=headers)
        assert huge.status_code == 413 and huge.json()["code"] == "payload_too_large"

        async def chunks():  # type: ignore[no-untyped-def]
            for _ in range(10):
                yield b" " * 1024

        streamed = await api.http.post("/v1/runs", content=chunks(), headers=headers)
        assert streamed.status_code == 413
        bad_cursor = await api.http.get("/v1/runs?cursor=%%%", headers=api.auth("alice"))
        assert bad_cursor.status_code == 422


async def test_runs_are_paginated(tmp_path) -> None:
    async with harness(tmp_path) as h, serve_api(h) as api:
        made = [(await start(api, script=None))["run_id"] for _ in range(5)]
        seen, cursor = [], None
        while True:
            page = (
                await api.http.get(
                    "/v1/runs",
                    params={"limit": 2, **({"cursor": cursor} if cursor else {})},
                    headers=api.auth("alice"),
                )
            ).json()
            seen += [r["run_id"] for r in page["items"]]
            cursor = page["next_cursor"]
            if not cursor:
                break
        assert sorted(seen) == sorted(made) and len(seen) == len(set(seen))


async def test_extend_an_approval(tmp_path) -> None:
    async with harness(tmp_path) as h, serve_api(h) as api:
        started = await start(api, approval_timeout_seconds=600)
        approval = await pending_approval(api, started["run_id"])
        path = f"/v1/approvals/{approval['id']}/extend"
        extended = await api.http.post(path, json={"seconds": 3600}, headers=api.auth("alice"))
        assert extended.status_code == 200, extended.text
        listed = await pending_approval(api, started["run_id"])
        assert listed["expires_at"] == extended.json()["expires_at"] != approval["expires_at"]
        too_long = await api.http.post(path, json={"seconds": 10**9}, headers=api.auth("alice"))
        assert too_long.status_code == 422
        assert (
            await api.http.post(path, json={"seconds": 60}, headers=api.auth("bob"))
        ).status_code == 404
        assert (
            await api.http.post(path, json={"seconds": 60}, headers=api.auth("svc"))
        ).status_code == 403
        events = (
            await api.http.get(f"/v1/runs/{started['run_id']}/events", headers=api.auth("alice"))
        ).json()["items"]
        extension = next(e for e in events if e["event_type"] == "approval.extended")
        assert extension["payload"]["by"] == "alice"


async def test_an_idempotent_replay_after_the_run_finished_starts_nothing(tmp_path) -> None:
    """Once seen on main: a replay after the run's workflow closed started a
    new execution under the same workflow id (Completed, then Failed)."""
    async with harness(tmp_path) as h, serve_api(h) as api:
        headers = {**api.auth("alice"), "Idempotency-Key": "order-7"}
        body = {"task_text": "t"}
        first = await api.http.post("/v1/runs", json=body, headers=headers)
        run_id = first.json()["run_id"]
        assert (await finished(api, run_id))["status"] == "completed"
        execution = (await h.client.get_workflow_handle(run_id).describe()).run_id

        again = await api.http.post("/v1/runs", json=body, headers=headers)
        assert again.status_code == 201 and again.headers.get("idempotent-replayed") == "true"
        assert again.json() == {"run_id": run_id, "workflow_id": run_id, "status": "completed"}
        assert (await h.client.get_workflow_handle(run_id).describe()).run_id == execution
        other = await api.http.post("/v1/runs", json={"task_text": "else"}, headers=headers)
        assert other.status_code == 409
        assert (await h.client.get_workflow_handle(run_id).describe()).run_id == execution


async def test_extend_on_a_closed_run_is_409_and_without_temporal_503(tmp_path) -> None:
    """Once a plain-text 500 for a closed run."""
    async with harness(tmp_path) as h, serve_api(h) as api:
        started = await start(api)
        approval = await pending_approval(api, started["run_id"])
        await h.client.get_workflow_handle(started["run_id"]).terminate(reason="test")
        closed = await api.http.post(
            f"/v1/approvals/{approval['id']}/extend",
            headers=api.auth("alice"),
            json={"seconds": 60},
        )
        assert closed.status_code == 409, closed.text
        assert closed.headers["content-type"] == "application/problem+json"
        assert "no live workflow" in closed.json()["detail"]

        other = await start(api)
        waiting = await pending_approval(api, other["run_id"])
        nowhere = Settings(database_url="sqlite+aiosqlite://", temporal_address="127.0.0.1:1")
        async with (
            serving(create_app(nowhere, store=h.store)) as port,
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as http,
        ):
            for path, body in (
                (f"/v1/approvals/{waiting['id']}/extend", {"seconds": 60}),
                (
                    f"/v1/approvals/{waiting['id']}/decision",
                    {"decision": "approved", "arguments_digest": waiting["arguments_digest"]},
                ),
            ):
                answer = await http.post(path, headers=api.auth("alice"), json=body)
                assert answer.status_code == 503, answer.text
                assert answer.json()["code"] == "temporal_unavailable"
