"""Requests that once answered 500, and lists that had no end: each is a 4xx
problem document or a page now. Real HTTP against the real app."""

from __future__ import annotations

import base64
from datetime import UTC, datetime, timedelta

from sqlalchemy import event

from tests.api_server import Api, serve_api
from tests.helpers import new_run, waiting_action
from tests.workflow_harness import harness


def _cursor(raw: str) -> str:
    return base64.urlsafe_b64encode(raw.encode()).decode()


async def test_a_cursor_with_a_naive_time_is_a_422_not_a_500(tmp_path) -> None:
    async with harness(tmp_path) as h, serve_api(h) as api:
        for raw in ("2024-01-01T00:00:00|run-x", "2024-01-01T00:00:00+00:00", "\x00|\x00"):
            answer = await api.http.get(
                "/v1/runs", params={"cursor": _cursor(raw)}, headers=api.auth("alice")
            )
            assert answer.status_code == 422, (raw, answer.text)
            assert answer.headers["content-type"] == "application/problem+json"
            assert answer.json()["errors"][0]["field"] == "cursor"
        aware = _cursor("2024-01-01T00:00:00+00:00|run-x")
        fine = await api.http.get("/v1/runs", params={"cursor": aware}, headers=api.auth("alice"))
        assert fine.status_code == 200, fine.text


async def test_codec_decode_of_1000_deep_json_is_a_422_not_a_500(tmp_path) -> None:
    async with harness(tmp_path) as h, serve_api(h) as api:
        headers = {**api.auth("ops"), "Content-Type": "application/json"}
        for body in (
            "[" * 1000 + "]" * 1000,
            '{"payloads": ' + "[" * 1000 + "]" * 1000 + "}",
            '{"payloads": [{"metadata": {"a": ' + '{"b": ' * 999 + "1" + "}" * 1000 + "}]}",
        ):
            for path in ("/codec/decode", "/codec/encode"):
                answer = await api.http.post(path, content=body.encode(), headers=headers)
                assert answer.status_code == 422, (path, answer.text[:300])
                assert answer.json()["code"] == "validation_error"
        # Brackets inside strings are text, not nesting.
        shallow = '{"payloads": [{"metadata": {"x": "' + "[" * 1000 + '"}}]}'
        answer = await api.http.post("/codec/decode", content=shallow.encode(), headers=headers)
        assert answer.status_code != 500, answer.text


async def _approvals_for(store, user: str, count: int) -> dict:  # type: ignore[no-untyped-def]
    """A run of ``user`` with ``count`` pending approvals, straight in the store."""
    run = await new_run(store, user_id=user)
    expires = datetime.now(UTC) + timedelta(hours=1)
    for n in range(count):
        await waiting_action(store, run, f"{run['id']}-{n}", expires)
    return run


async def _all_pages(api: Api, path: str, who: str, limit: int, **params: str) -> list[list]:
    pages, cursor = [], None
    while True:
        query = {"limit": str(limit), **params, **({"cursor": cursor} if cursor else {})}
        answer = await api.http.get(path, params=query, headers=api.auth(who))
        assert answer.status_code == 200, answer.text
        body = answer.json()
        pages.append(body["items"])
        cursor = body["next_cursor"]
        if not cursor:
            return pages


async def test_approvals_events_and_deliveries_are_paged_like_runs(tmp_path) -> None:
    async with harness(tmp_path) as h, serve_api(h) as api:
        mine = await _approvals_for(h.store, "alice", 5)
        await _approvals_for(h.store, "bob", 2)
        pages = await _all_pages(api, "/v1/approvals", "alice", 2)
        assert [len(p) for p in pages] == [2, 2, 1]
        ids = [a["id"] for p in pages for a in p]
        assert len(ids) == len(set(ids)) == 5
        assert {a["run_id"] for p in pages for a in p} == {mine["id"]}
        everyone = await _all_pages(api, "/v1/approvals", "ops", 3)
        assert sum(len(p) for p in everyone) == 7

        events = await _all_pages(api, f"/v1/runs/{mine['id']}/events", "alice", 4)
        seqs = [e["seq"] for p in events for e in p]
        assert seqs == list(range(1, len(seqs) + 1)) and len(seqs) > 8
        assert all(len(p) <= 4 for p in events)

        for n in range(5):
            await h.store.record_webhook_attempt(
                delivery_id=f"d-{n}",
                run_id=mine["id"],
                event_type="approval.requested",
                url="http://receiver.invalid/hook",
                attempt=1,
                status_code=200,
                error=None,
                delivered=True,
            )
        deliveries = await _all_pages(api, "/v1/webhook-deliveries", "ops", 2)
        assert [len(p) for p in deliveries] == [2, 2, 1]
        assert [d["delivery_id"] for p in deliveries for d in p] == [f"d-{n}" for n in range(5)]
        for path in ("/v1/approvals", f"/v1/runs/{mine['id']}/events", "/v1/webhook-deliveries"):
            for bad in ("%%%", "0", _cursor("x|y"), _cursor("-1")):
                answer = await api.http.get(path, params={"cursor": bad}, headers=api.auth("ops"))
                assert answer.status_code == 422, (path, bad, answer.text)
            too_many = await api.http.get(path, params={"limit": 1000}, headers=api.auth("ops"))
            assert too_many.status_code == 422


async def test_listing_approvals_makes_no_query_per_row(tmp_path) -> None:
    async with harness(tmp_path) as h, serve_api(h) as api:
        statements: list[str] = []

        def count(_conn, _cursor, statement, *_args) -> None:  # type: ignore[no-untyped-def]
            statements.append(statement)

        async def queries_to_list(who: str) -> int:
            statements.clear()
            event.listen(h.store.engine.sync_engine, "before_cursor_execute", count)
            try:
                answer = await api.http.get("/v1/approvals", headers=api.auth(who))
            finally:
                event.remove(h.store.engine.sync_engine, "before_cursor_execute", count)
            assert answer.status_code == 200
            return len(statements)

        await _approvals_for(h.store, "alice", 2)
        few_user, few_ops = await queries_to_list("alice"), await queries_to_list("ops")
        await _approvals_for(h.store, "alice", 10)
        assert await queries_to_list("alice") == few_user
        assert await queries_to_list("ops") == few_ops
        listed = (await api.http.get("/v1/approvals", headers=api.auth("alice"))).json()["items"]
        assert len(listed) == 12 and all(a["tool_name"] for a in listed)


async def test_a_405_names_every_method_and_a_413_closes_its_connection(tmp_path) -> None:
    """Found by schemathesis: Allow named only POST for /v1/runs; and after a
    413 answered before the body was read, the unread rest of the body was
    taken for the next request on the same connection, which then hung."""
    async with harness(tmp_path) as h, serve_api(h, max_body_bytes=1024) as api:
        refused = await api.http.request("OPTIONS", "/v1/runs", headers=api.auth("ops"))
        assert refused.status_code == 405
        assert refused.headers["allow"] == "GET, POST"
        for _ in range(3):  # the same connection carries the next request each time
            too_big = await api.http.post(
                "/v1/runs", content=b"{" + b" " * 300_000 + b"}", headers=api.auth("ops")
            )
            assert too_big.status_code == 413 and "connection" not in too_big.headers
            after = await api.http.get("/v1/runs", headers=api.auth("ops"))
            assert after.status_code == 200


async def test_cursors_and_event_ids_out_of_range_are_refused_not_500s(tmp_path) -> None:
    """Found in review: a cursor time UTC cannot hold, and a Last-Event-ID
    that str.isdigit() accepts but int() does not (or SQLite cannot store)."""
    async with harness(tmp_path) as h, serve_api(h) as api:
        for path in ("/v1/runs", "/v1/approvals"):
            for moment in ("0001-01-01T00:00:00+14:00", "9999-12-31T23:59:59-14:00"):
                answer = await api.http.get(
                    path, params={"cursor": _cursor(f"{moment}|x")}, headers=api.auth("ops")
                )
                assert answer.status_code == 422, (path, moment, answer.text)
        run = await _approvals_for(h.store, "alice", 1)
        stream = {**api.auth("alice"), "Accept": "text/event-stream"}
        for last in ("\u00b2".encode("latin-1"), b"9" * 30):
            async with api.http.stream(
                "GET", f"/v1/runs/{run['id']}/events", headers={**stream, "Last-Event-ID": last}
            ) as answer:
                assert answer.status_code == 200
                first = await anext(answer.aiter_lines())
                assert first.startswith("id: 1")  # from the start, as for no id
