"""The approvals inbox under attack (issue 15 review): the real API over real
HTTP, a real worker. Hostile data in every rendered field, CSRF and session
tricks, bad input, and who sees the live stream."""

from __future__ import annotations

import asyncio
import json

import httpx

from tests.api_server import serve_api
from tests.test_api import finished, pending_approval, start
from tests.test_inbox_http import CSRF, browser, decision, sign_in
from tests.workflow_harness import harness, ticket_call

XSS = "</pre><script>alert(1)</script><img src=x onerror=alert(2)>\"'`"


def no_raw_markup(text: str) -> None:
    assert "<script>alert" not in text and "<img src=x" not in text, text
    assert "onerror=alert(2)>" not in text


async def test_hostile_task_transcript_and_arguments_are_escaped(tmp_path) -> None:
    call = ticket_call("ticket_update", "T-1", fields={"priority": XSS})
    said = {
        "turns": [{"seat": "seat-1", "round": 1, "text": f"I say {XSS}", "tool_calls": [call]}],
        "final": "done",
    }
    async with harness(tmp_path) as h, serve_api(h) as api:
        started = await start(api, task_text=f"task {XSS}", script=said)
        approval = await pending_approval(api, started["run_id"])
        async with browser(api) as alice:
            await sign_in(alice, api.tokens["alice"])
            inbox = await alice.get("/inbox")
            assert approval["id"] in inbox.text and "&lt;script&gt;alert(1)" in inbox.text
            no_raw_markup(inbox.text)
            csp = inbox.headers["content-security-policy"]
            assert "script-src 'self'" in csp and "unsafe-inline" not in csp
            assert "<script>" not in inbox.text.replace(
                '<script src="/inbox/static/inbox.js" defer></script>', ""
            )
            run_page = await alice.get(f"/inbox/runs/{started['run_id']}")
            assert "I say" in run_page.text
            no_raw_markup(run_page.text)
            # The live stream carries the same escaped entry (inserted by the
            # page as HTML): nothing raw in it either.
            async with alice.stream("GET", "/inbox/events") as stream:
                assert stream.headers["content-type"].startswith("text/event-stream")
                lines = stream.aiter_lines()
                first = ""
                async for line in lines:
                    if line.startswith("data: "):
                        first = line[6:]
                        break
            data = json.loads(first)
            assert data["ids"] == [approval["id"]]
            no_raw_markup(data["html"][approval["id"]])
            # A run id in a URL is only ever this server's path.
            lost = await alice.get("/inbox/runs/%3Cscript%3Ealert(1)%3C%2Fscript%3E")
            assert lost.status_code == 404
            no_raw_markup(lost.text)


async def test_the_live_stream_shows_only_the_callers_approvals(tmp_path) -> None:
    async with harness(tmp_path) as h, serve_api(h) as api:
        started = await start(api, who="alice")
        approval = await pending_approval(api, started["run_id"])
        async with browser(api) as bob:
            await sign_in(bob, api.tokens["bob"])
            async with bob.stream("GET", "/inbox/events") as stream:
                async for line in stream.aiter_lines():
                    if line.startswith("data: "):
                        data = json.loads(line[6:])
                        break
            assert data == {"ids": [], "html": {}}
            assert approval["id"] not in json.dumps(data)
        async with httpx.AsyncClient(base_url=api.http.base_url) as anonymous:
            assert (await anonymous.get("/inbox/events")).status_code == 401


async def test_bad_input_gets_a_clear_4xx_and_changes_nothing(tmp_path) -> None:
    async with harness(tmp_path) as h, serve_api(h) as api:
        started = await start(api)
        approval = await pending_approval(api, started["run_id"])
        path = f"/inbox/approvals/{approval['id']}/decision"
        async with browser(api) as alice:
            csrf = await sign_in(alice, api.tokens["alice"])
            ok = {"X-CSRF-Token": csrf, "Content-Type": "application/json"}
            bodies = [
                b"",
                b"not json",
                b"\xff\xfe\x00garbage",
                b"[" * 50_000,  # nested past Python's recursion limit
                b'{"decision": "approved"}',
                b'{"decision": 1, "arguments_digest": []}',
                b'{"decision": "approved", "arguments_digest": "x", "arguments": []}',
                b'{"decision": "approved", "arguments_digest": "x", "evil": 1}',
                json.dumps(decision(approval, arguments={"fields": {"p": float("nan")}})).encode(),
            ]
            for raw in bodies:
                answer = await alice.post(path, content=raw, headers=ok)
                assert 400 <= answer.status_code < 500, (raw[:40], answer.status_code, answer.text)
            for raw in (b"[" * 50_000, b"{}", b'{"seconds": "soon"}', b'{"seconds": -5}'):
                answer = await alice.post(
                    f"/inbox/approvals/{approval['id']}/extend", content=raw, headers=ok
                )
                assert 400 <= answer.status_code < 500, (raw[:40], answer.status_code)
            unknown = await alice.post(
                "/inbox/approvals/nope/decision", json=decision(approval), headers=ok
            )
            assert unknown.status_code == 404
            unknown = await alice.post(
                "/inbox/actions/nope/reconcile",
                json={"outcome": "failed", "note": "x"},
                headers=ok,
            )
            assert unknown.status_code == 404
            assert (await alice.get("/inbox/approvals/nope/edit")).status_code == 404

            # A CSRF token that is not ASCII (header or form field): refused, not a crash.
            for weird in ("é" * 64, "\u2603"):
                answer = await alice.post(
                    path,
                    json=decision(approval),
                    headers={"X-CSRF-Token": weird.encode()},
                )
                assert answer.status_code == 403, answer.text
                out = await alice.post("/inbox/logout", data={"csrf_token": weird})
                assert out.status_code == 403, out.text

            # Sign-in with a body that is no form at all.
            for raw, kind in (
                (b"token=\xff\xfe", "application/x-www-form-urlencoded"),
                (b"--x\r\nbroken", "multipart/form-data; boundary=x"),
                (b"token=" + b"a" * 200_000, "application/x-www-form-urlencoded"),
            ):
                async with browser(api) as fresh:
                    answer = await fresh.post(
                        "/inbox/login", content=raw, headers={"Content-Type": kind}
                    )
                    assert 400 <= answer.status_code < 500, (raw[:20], answer.status_code)
                    assert "set-cookie" not in answer.headers
            too_big = await alice.post(path, content=b" " * 400_000, headers=ok)
            assert too_big.status_code == 413
            assert (await pending_approval(api, started["run_id"]))["status"] == "pending"


async def test_a_decision_that_lost_the_race_changes_nothing(tmp_path) -> None:
    async with harness(tmp_path) as h, serve_api(h) as api:
        started = await start(api)
        approval = await pending_approval(api, started["run_id"])
        path = f"/inbox/approvals/{approval['id']}/decision"
        async with browser(api) as one, browser(api) as two:
            c1 = await sign_in(one, api.tokens["alice"])
            c2 = await sign_in(two, api.tokens["alice"])
            answers = await asyncio.gather(
                one.post(path, json=decision(approval), headers={"X-CSRF-Token": c1}),
                two.post(
                    path,
                    json={
                        "decision": "rejected",
                        "reason": "no",
                        "arguments_digest": approval["arguments_digest"],
                    },
                    headers={"X-CSRF-Token": c2},
                ),
            )
            codes = sorted(a.status_code for a in answers)
            assert codes == [200, 409], [a.text for a in answers]


async def test_sessions_rotate_and_resist_cross_site_sign_in(tmp_path) -> None:
    # A session long enough that the browser's cookie outlives the test: with
    # 2 s, a loaded machine let it lapse in the browser (which keeps expiry in
    # whole seconds) before the second sign-in, which then had no session to
    # end, while the server still held it live (CI, 2026-12-08).
    async with harness(tmp_path) as h, serve_api(h) as api:
        async with browser(api) as alice:
            await sign_in(alice, api.tokens["alice"])
            first = alice.cookies.get("rt_inbox")
            # Signing in again (say, as someone else) ends the session the
            # browser held: no old session stays live behind a new cookie.
            again = await alice.post("/inbox/login", data={"token": api.tokens["bob"]})
            assert again.status_code == 303
            second = again.cookies.get("rt_inbox")
            assert second and second != first
            replay = httpx.Cookies()
            replay.set("rt_inbox", first, path="/inbox")
            async with httpx.AsyncClient(base_url=api.http.base_url, cookies=replay) as old:
                assert (await old.get("/inbox", follow_redirects=False)).status_code == 303

            # Login CSRF: a cross-site form (Origin, or only Sec-Fetch-Site /
            # Referer when a browser sends no Origin) is refused.
            for headers in (
                {"Origin": "http://evil.example"},
                {"Origin": "null"},
                {"Sec-Fetch-Site": "cross-site"},
                {"Referer": "http://evil.example/page"},
            ):
                async with browser(api) as victim:
                    forged = await victim.post(
                        "/inbox/login", data={"token": api.tokens["bob"]}, headers=headers
                    )
                    assert forged.status_code == 403, (headers, forged.status_code)
                    assert "set-cookie" not in forged.headers
            # The page's own form (same origin) signs in.
            base = str(api.http.base_url).rstrip("/")
            async with browser(api) as same:
                answer = await same.post(
                    "/inbox/login",
                    data={"token": api.tokens["bob"]},
                    headers={
                        "Origin": base,
                        "Sec-Fetch-Site": "same-origin",
                        "Referer": f"{base}/inbox/login",
                    },
                )
                assert answer.status_code == 303
            # No open redirect: a next= parameter is ignored.
            async with browser(api) as same:
                answer = await same.post(
                    "/inbox/login?next=https://evil.example",
                    data={"token": api.tokens["bob"], "next": "https://evil.example"},
                )
                assert answer.headers["location"] == "/inbox"
            # Sign-out is POST only.
            assert (await alice.get("/inbox/logout")).status_code == 405


async def test_the_server_ends_a_session_at_its_expiry_whatever_the_browser_keeps(
    tmp_path,
) -> None:
    async with harness(tmp_path) as h, serve_api(h, inbox_session_seconds=2) as api:
        async with browser(api) as alice:
            await sign_in(alice, api.tokens["alice"])
            session = alice.cookies.get("rt_inbox")
        assert session
        await asyncio.sleep(2.5)
        kept = httpx.Cookies()
        kept.set("rt_inbox", session, path="/inbox")
        async with httpx.AsyncClient(base_url=api.http.base_url, cookies=kept) as late:
            assert (await late.get("/inbox", follow_redirects=False)).status_code == 303
            assert (await late.get("/inbox/events")).status_code == 401


async def test_roles_on_the_pages_posts(tmp_path) -> None:
    """A service token may see an approval but not decide it, edited or not
    (403 before the edit is even looked at); a user may not reconcile."""
    async with harness(tmp_path) as h, serve_api(h) as api:
        started = await start(api)
        approval = await pending_approval(api, started["run_id"])
        path = f"/inbox/approvals/{approval['id']}/decision"
        async with browser(api) as svc:
            csrf = await sign_in(svc, api.tokens["svc"])
            for arguments in ({"tenant_id": "acme"}, {"tenant_id": "acme", "ticket_id": "T-1"}):
                refused = await svc.post(
                    path,
                    json=decision(approval, arguments=arguments),
                    headers={"X-CSRF-Token": csrf},
                )
                assert refused.status_code == 403, refused.text
            edit = await svc.get(f"/inbox/approvals/{approval['id']}/edit")
            assert edit.status_code == 403
        async with browser(api) as alice:
            csrf = await sign_in(alice, api.tokens["alice"])
            edit = await alice.get(f"/inbox/approvals/{approval['id']}/edit")
            assert edit.status_code == 200
            assert edit.headers["cache-control"] == "no-store"
            run = (
                await api.http.get(f"/v1/runs/{started['run_id']}", headers=api.auth("alice"))
            ).json()
            reconcile = await alice.post(
                f"/inbox/actions/{run['actions'][0]['id']}/reconcile",
                json={"outcome": "failed", "note": "x"},
                headers={"X-CSRF-Token": csrf},
            )
            assert reconcile.status_code == 403
        assert (await pending_approval(api, started["run_id"]))["status"] == "pending"
        assert CSRF  # the page's pattern, shared with test_inbox_http


async def test_a_broken_tool_schema_refuses_the_edit_cleanly(tmp_path, monkeypatch) -> None:
    """An MCP server's inputSchema is its own word: one with a bad regex, a
    remote $ref or a wrong type somewhere an edit reaches gets a 422 naming
    the problem, never a 500, and the approval stays pending."""
    from api.inbox import routes

    broken = {
        "type": "object",
        "properties": {
            "ticket_id": {"type": "string", "pattern": "("},
            "fields": {"$ref": "http://127.0.0.1:9/schema.json"},
            "tenant_id": {"type": 5},
        },
    }

    async def schema(ctx, run_id, tool_name):  # type: ignore[no-untyped-def]
        return broken

    monkeypatch.setattr(routes, "_tool_schema", schema)
    async with harness(tmp_path) as h, serve_api(h) as api:
        started = await start(api)
        approval = await pending_approval(api, started["run_id"])
        async with browser(api) as alice:
            csrf = await sign_in(alice, api.tokens["alice"])
            for arguments in ({"ticket_id": "T-1"}, {"fields": {"p": 1}}, {"tenant_id": "a"}):
                answer = await alice.post(
                    f"/inbox/approvals/{approval['id']}/decision",
                    json=decision(approval, arguments=arguments),
                    headers={"X-CSRF-Token": csrf},
                )
                assert answer.status_code == 422, (arguments, answer.status_code, answer.text)
                assert "schema" in answer.json()["detail"]
        assert (await pending_approval(api, started["run_id"]))["status"] == "pending"


async def test_the_temporal_ui_origin_cannot_read_the_inbox(tmp_path) -> None:
    """The API lets the Temporal UI's origins (ui_origins) call the codec with
    credentials. That origin is same-site with the API (same host, another
    port), so a browser sends it the SameSite=Strict inbox cookie: the CORS
    grant must not extend to /inbox, or a script there could read the pending
    approvals, the transcripts and the CSRF token."""
    ui = "http://127.0.0.1:8233"
    async with harness(tmp_path) as h, serve_api(h, ui_origins=[ui]) as api:
        started = await start(api)
        approval = await pending_approval(api, started["run_id"])
        async with browser(api) as alice:
            csrf = await sign_in(alice, api.tokens["alice"])
            cross = {"Origin": ui, "Sec-Fetch-Site": "same-site"}
            for path in (
                "/inbox",
                f"/inbox/runs/{started['run_id']}",
                f"/inbox/approvals/{approval['id']}/edit",
                "/inbox/unknown",
            ):
                answer = await alice.get(path, headers=cross)
                assert "access-control-allow-origin" not in answer.headers, path
                assert "access-control-allow-credentials" not in answer.headers, path
            preflight = await alice.options(
                f"/inbox/approvals/{approval['id']}/decision",
                headers={
                    "Origin": ui,
                    "Access-Control-Request-Method": "POST",
                    "Access-Control-Request-Headers": "x-csrf-token, content-type",
                },
            )
            assert "access-control-allow-origin" not in preflight.headers
            forged = await alice.post(
                f"/inbox/approvals/{approval['id']}/decision",
                json=decision(approval),
                headers={**cross, "X-CSRF-Token": csrf},
            )
            assert forged.status_code == 403
            # The codec keeps its grant.
            codec = await alice.options(
                "/codec/decode",
                headers={"Origin": ui, "Access-Control-Request-Method": "POST"},
            )
            assert codec.headers.get("access-control-allow-origin") == ui
        assert (await pending_approval(api, started["run_id"]))["status"] == "pending"


async def test_a_secret_an_operator_typed_into_an_edit_stays_out_of_the_run_page(
    tmp_path,
) -> None:
    """An operator replaces a comment's (secret) body in the edit form; the
    write runs with it and a seat, told the result, quotes it. The run page's
    transcript redacts the seats' own tool-call arguments, and must redact the
    arguments the writes actually ran with too."""
    typed = "edited-secret-0815-xyz"
    call = ticket_call("ticket_comment", "T-3", body="original-secret-4711")
    said = {
        "turns": [
            {"seat": "seat-1", "round": 1, "text": "posting a comment", "tool_calls": [call]},
            {"seat": "seat-1", "round": 2, "text": f"The comment now reads {typed}."},
        ],
        "final": "done",
    }
    async with harness(tmp_path) as h, serve_api(h) as api:
        started = await start(api, script=said, max_rounds=2)
        approval = await pending_approval(api, started["run_id"])
        async with browser(api) as alice:
            csrf = await sign_in(alice, api.tokens["alice"])
            edited = await alice.post(
                f"/inbox/approvals/{approval['id']}/decision",
                json=decision(
                    approval, arguments={"tenant_id": "acme", "ticket_id": "T-3", "body": typed}
                ),
                headers={"X-CSRF-Token": csrf},
            )
            assert edited.status_code == 200, edited.text
            assert typed not in edited.text
            run = await finished(api, started["run_id"])
            assert run["status"] == "completed", run
            page = (await alice.get(f"/inbox/runs/{started['run_id']}")).text
            assert "The comment now reads" in page, page
            assert typed not in page
            assert typed not in (await alice.get("/inbox")).text


async def test_the_transcript_works_out_each_secret_once_not_once_per_message(
    tmp_path, monkeypatch
) -> None:
    """Redaction's cost grows with the secret values' length (every spelling,
    every 12-character window). A run page spent it again for every message
    of the transcript, on the API's event loop: a seat passing one long
    secret and then talking a lot made every view of its run page stall the
    API. The secrets' spellings are worked out once per page."""
    from roundtable import security

    calls = 0
    spellings = security._spellings

    def counted(value: str) -> set[str]:
        nonlocal calls
        calls += 1
        return spellings(value)

    monkeypatch.setattr(security, "_spellings", counted)
    call = ticket_call("ticket_comment", "T-3", body="a-long-secret-body " * 50)
    turns = [{"seat": "seat-1", "round": 1, "text": "posting", "tool_calls": [call]}]
    turns += [
        {"seat": seat, "round": r, "text": f"{seat} talks in round {r}"}
        for r in range(2, 6)
        for seat in ("seat-1", "seat-2")
    ]
    async with harness(tmp_path) as h, serve_api(h) as api:
        started = await start(api, script={"turns": turns, "final": "done"}, max_rounds=5)
        approval = await pending_approval(api, started["run_id"])
        async with browser(api) as alice:
            csrf = await sign_in(alice, api.tokens["alice"])
            done = await alice.post(
                f"/inbox/approvals/{approval['id']}/decision",
                json=decision(approval),
                headers={"X-CSRF-Token": csrf},
            )
            assert done.status_code == 200
            await finished(api, started["run_id"])
            calls = 0
            page = (await alice.get(f"/inbox/runs/{started['run_id']}")).text
            assert page.count('<p class="speaker">') >= 8
            # Two secret leaves (the body, as the seat passed it and as it was
            # written), however many messages.
            assert calls <= 2, calls


async def test_the_unknown_page_never_shows_what_an_attempt_reported_of_a_secret(
    tmp_path,
) -> None:
    """An unknown write's result keeps, as evidence, what its attempt reported
    after it was made unknown: the tool's own result, which may quote the
    secret argument (a created comment's body). With no error message to
    show, the page's "last error" printed that whole result."""
    from tests.helpers import new_action, new_run, target_for

    secret = "s3cret-comment-body-4242"
    async with harness(tmp_path) as h, serve_api(h) as api:
        run = await new_run(h.store, user_id="alice")
        action = await new_action(
            h.store,
            run,
            key="u2",
            target_key=target_for("task-u2"),
            arguments={"ticket_id": "T-1", "body": secret},
            safe_argument_fields=["ticket_id"],
        )
        await h.store.claim_action_for_execution(action["id"], 600)
        await h.store.record_action_terminal_result(
            action["id"], "unknown", {"error_code": "execution_interrupted"}
        )
        await h.store.record_action_terminal_result(
            action["id"], "succeeded", {"comment": {"id": 7, "body": secret}}
        )
        async with browser(api) as ops:
            await sign_in(ops, api.tokens["ops"])
            page = (await ops.get("/inbox/unknown")).text
            assert f'data-action-id="{action["id"]}"' in page
            assert "execution_interrupted" in page
            assert secret not in page
