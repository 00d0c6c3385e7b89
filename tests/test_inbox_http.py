"""The approvals inbox (issue 15) at the HTTP level: the real API over real
HTTP, a real worker on the time-skipping server. Sign-in, the cookie, CSRF,
sign-out, and the API's own rules on who sees and decides what."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
from sqlalchemy import text

from roundtable.permissions import Authority
from tests.api_server import Api, serve_api
from tests.helpers import new_action, new_run, target_for
from tests.test_api import finished, pending_approval, start
from tests.workflow_harness import TRUSTING, harness, script, ticket_call

CSRF = re.compile(r'<meta name="csrf-token" content="([0-9a-f]+)">')


@asynccontextmanager
async def browser(api: Api) -> AsyncIterator[httpx.AsyncClient]:
    """A client with a cookie jar of its own (one person's browser)."""
    async with httpx.AsyncClient(base_url=api.http.base_url, timeout=30) as http:
        yield http


async def sign_in(http: httpx.AsyncClient, token: str) -> str:
    """Sign in; the page's CSRF token."""
    answer = await http.post("/inbox/login", data={"token": token})
    assert answer.status_code == 303, answer.text
    assert answer.headers["location"] == "/inbox"
    page = await http.get("/inbox")
    assert page.status_code == 200, page.text
    return CSRF.search(page.text).group(1)


def decision(approval: dict, **extra: object) -> dict:
    return {"decision": "approved", "arguments_digest": approval["arguments_digest"], **extra}


async def test_sign_in_cookie_csrf_and_sign_out(tmp_path) -> None:
    async with harness(tmp_path) as h, serve_api(h) as api, browser(api) as http:
        started = await start(api)
        approval = await pending_approval(api, started["run_id"])

        assert (await http.get("/inbox", follow_redirects=False)).headers[
            "location"
        ] == "/inbox/login"
        login_page = await http.get("/inbox/login")
        assert 'name="token"' in login_page.text
        bad = await http.post("/inbox/login", data={"token": "rt_wrong"})
        assert bad.status_code == 401 and "unknown or revoked token" in bad.text
        assert "set-cookie" not in bad.headers
        codec = await http.post("/inbox/login", data={"token": api.tokens["ui"]})
        assert codec.status_code == 403 and "set-cookie" not in codec.headers

        answer = await http.post("/inbox/login", data={"token": api.tokens["alice"]})
        assert answer.status_code == 303
        cookie = answer.headers["set-cookie"]
        flags = {part.strip().lower() for part in cookie.split(";")[1:]}
        assert {"httponly", "samesite=strict", "path=/inbox"} <= flags
        assert "secure" not in flags  # plain HTTP here; ROUNDTABLE_INBOX_COOKIE_SECURE sets it
        session_id = cookie.split(";")[0].split("=", 1)[1]
        assert api.tokens["alice"] not in cookie

        # At rest: only the session id's hash; neither it nor the CSRF token plain.
        page = await http.get("/inbox")
        csrf = CSRF.search(page.text).group(1)
        async with h.store.engine.connect() as db:
            rows = (await db.execute(text("SELECT * FROM inbox_sessions"))).all()
        assert len(rows) == 1
        assert session_id not in repr(rows) and csrf not in repr(rows)
        assert api.tokens["alice"] not in repr(rows)

        # The page: the pending approval with its hooks, the redacted view, headers.
        assert f'data-approval-id="{approval["id"]}"' in page.text
        for action in ("approve", "reject", "edit", "extend"):
            assert f'data-action="{action}"' in page.text
        assert page.headers["x-frame-options"] == "DENY"
        assert "frame-ancestors 'none'" in page.headers["content-security-policy"]
        assert "https://" not in page.text and "http://" not in page.text  # no CDN
        for asset in ("inbox.js", "inbox.css"):
            served = await http.get(f"/inbox/static/{asset}")
            assert served.status_code == 200 and served.text

        path = f"/inbox/approvals/{approval['id']}/decision"
        body = decision(approval)
        for headers in (
            {},
            {"X-CSRF-Token": "0" * 64},
            {"X-CSRF-Token": csrf, "Origin": "http://evil.example"},
        ):
            refused = await http.post(path, json=body, headers=headers)
            assert refused.status_code == 403, refused.text
            assert refused.json()["code"] == "csrf_refused"
        # A form posted from elsewhere: no token, refused, nothing changed.
        forged = await http.post(path, data={"decision": "approved"})
        assert forged.status_code == 403
        assert (await pending_approval(api, started["run_id"]))["status"] == "pending"

        done = await http.post(path, json=body, headers={"X-CSRF-Token": csrf})
        assert done.status_code == 200, done.text
        assert done.json()["status"] == "approved"
        run = await finished(api, started["run_id"])
        assert run["status"] == "completed" and run["approvals"][0]["decided_by"] == "alice"
        assert len(await h.tickets.write_log()) == 1
        # Lost the race: decided already; says so, changes nothing.
        again = await http.post(path, json=body, headers={"X-CSRF-Token": csrf})
        assert again.status_code == 409 and "already approved" in again.json()["detail"]

        run_page = await http.get(f"/inbox/runs/{started['run_id']}")
        assert run_page.status_code == 200
        assert 'data-chain="verified"' in run_page.text
        assert 'class="fencing-token">1<' in run_page.text

        # Sign-out (with the CSRF token) revokes the session for good.
        assert (await http.post("/inbox/logout", data={})).status_code == 403
        out = await http.post("/inbox/logout", data={"csrf_token": csrf}, follow_redirects=False)
        assert out.status_code == 303 and out.headers["location"] == "/inbox/login"
        replay = httpx.Cookies()
        replay.set("rt_inbox", session_id, path="/inbox")
        async with httpx.AsyncClient(base_url=api.http.base_url, cookies=replay) as stolen:
            assert (await stolen.get("/inbox", follow_redirects=False)).status_code == 303
            late = await stolen.post(path, json=body, headers={"X-CSRF-Token": csrf})
            assert late.status_code == 401


async def test_visibility_roles_and_revoked_tokens(tmp_path) -> None:
    async with harness(tmp_path) as h, serve_api(h) as api:
        started = await start(api, who="alice")
        approval = await pending_approval(api, started["run_id"])
        async with browser(api) as bob, browser(api) as ops, browser(api) as svc:
            bob_csrf = await sign_in(bob, api.tokens["bob"])
            page = await bob.get("/inbox")
            assert approval["id"] not in page.text and "Nothing waits for you" in page.text
            assert (await bob.get(f"/inbox/runs/{started['run_id']}")).status_code == 404
            assert (await bob.get(f"/inbox/approvals/{approval['id']}/edit")).status_code == 404
            refused = await bob.post(
                f"/inbox/approvals/{approval['id']}/decision",
                json=decision(approval),
                headers={"X-CSRF-Token": bob_csrf},
            )
            assert refused.status_code == 404

            # A service token sees every run but decides none (the API's rule).
            svc_csrf = await sign_in(svc, api.tokens["svc"])
            assert approval["id"] in (await svc.get("/inbox")).text
            forbidden = await svc.post(
                f"/inbox/approvals/{approval['id']}/decision",
                json=decision(approval),
                headers={"X-CSRF-Token": svc_csrf},
            )
            assert forbidden.status_code == 403

            ops_csrf = await sign_in(ops, api.tokens["ops"])
            assert approval["id"] in (await ops.get("/inbox")).text
            # Edits are checked against the tool's schema by the page's server too.
            form = (await ops.get(f"/inbox/approvals/{approval['id']}/edit")).json()
            assert form["schema"]["properties"]["fields"]["minProperties"] == 1
            assert form["arguments_digest"] == approval["arguments_digest"]
            invalid = await ops.post(
                f"/inbox/approvals/{approval['id']}/decision",
                json=decision(approval, arguments={"tenant_id": "acme", "ticket_id": "T-1"}),
                headers={"X-CSRF-Token": ops_csrf},
            )
            assert invalid.status_code == 422 and "fields" in invalid.text
            edited = await ops.post(
                f"/inbox/approvals/{approval['id']}/decision",
                json=decision(
                    approval,
                    arguments={"tenant_id": "acme", "ticket_id": "T-1", "fields": {"p": "low"}},
                ),
                headers={"X-CSRF-Token": ops_csrf},
            )
            assert edited.status_code == 200, edited.text
            await finished(api, started["run_id"])
            (write,) = await h.tickets.write_log()
            assert (await h.tickets.read("acme", "T-1"))["fields"] == {"p": "low"}, write

            # Revoking the API token ends the sessions opened with it.
            record = next(t for t in await h.store.list_tokens() if t["user_id"] == "ops")
            await h.store.revoke_token(record["id"])
            assert (await ops.get("/inbox", follow_redirects=False)).status_code == 303


async def test_separation_of_duties_holds_in_the_inbox(tmp_path) -> None:
    others = Authority(
        ceilings=TRUSTING.ceilings,
        approvers="others",
        operator_risk="none",
        allowed_models=TRUSTING.allowed_models,
    )
    async with (
        harness(tmp_path, authority=others) as h,
        serve_api(
            h, approvers="others", operator_approval_risk="none", inbox_cookie_secure=True
        ) as api,
    ):
        started = await start(api, who="ops")  # an operator's own run
        approval = await pending_approval(api, started["run_id"], who="ops")
        async with browser(api) as ops:
            # Behind HTTPS the cookie is Secure (this client, on plain HTTP, is
            # handed it by hand).
            answer = await ops.post("/inbox/login", data={"token": api.tokens["ops"]})
            cookie = answer.headers["set-cookie"]
            assert "secure" in {p.strip().lower() for p in cookie.split(";")}
            ops.cookies.set("rt_inbox", cookie.split(";")[0].split("=", 1)[1], path="/inbox")
            csrf = CSRF.search((await ops.get("/inbox")).text).group(1)
            own = await ops.post(
                f"/inbox/approvals/{approval['id']}/decision",
                json=decision(approval),
                headers={"X-CSRF-Token": csrf},
            )
            assert own.status_code == 403, own.text
            assert (await pending_approval(api, started["run_id"], who="ops"))["status"] == (
                "pending"
            )


async def test_unknown_actions_page_and_a_reconcile_refused_while_the_attempt_may_run(
    tmp_path,
) -> None:
    """An unknown write whose lease is still live (its worker may be frozen,
    not dead): listed with what is known; reconciling it is refused with the
    reason and the time to retry, and nothing changes."""
    async with harness(tmp_path) as h, serve_api(h) as api:
        run = await new_run(h.store, user_id="alice")
        action = await new_action(h.store, run, key="u1", target_key=target_for("task-u1"))
        await h.store.claim_action_for_execution(action["id"], 600)
        await h.store.record_action_terminal_result(
            action["id"], "unknown", {"error": "connection reset by peer"}
        )
        async with browser(api) as ops, browser(api) as alice, browser(api) as bob:
            ops_csrf = await sign_in(ops, api.tokens["ops"])
            page = (await ops.get("/inbox/unknown")).text
            assert f'data-action-id="{action["id"]}"' in page
            assert "connection reset by peer" in page and 'value="succeeded"' in page
            refused = await ops.post(
                f"/inbox/actions/{action['id']}/reconcile",
                json={"outcome": "failed", "note": "ticket unchanged"},
                headers={"X-CSRF-Token": ops_csrf},
            )
            assert refused.status_code == 409, refused.text
            assert refused.json()["code"] == "attempt_may_be_running"
            assert refused.json()["retry_at"]
            assert (await h.store.get_action(action["id"]))["status"] == "unknown"

            await sign_in(alice, api.tokens["alice"])
            mine = (await alice.get("/inbox/unknown")).text
            assert action["id"] in mine and "Only operators reconcile" in mine
            await sign_in(bob, api.tokens["bob"])
            assert action["id"] not in (await bob.get("/inbox/unknown")).text


async def test_tenants_hold_for_edits_made_in_the_inbox(tmp_path) -> None:
    """Carol acts for initech only: an edit moving her write to acme is
    refused by the same rule as through the API, and nothing changes."""
    async with harness(tmp_path) as h, serve_api(h) as api:
        call = ticket_call("ticket_update", "T-9", tenant_id="initech")
        started = await start(api, who="carol", script=script(("seat-1", 1, [call])))
        approval = await pending_approval(api, started["run_id"], who="carol")
        async with browser(api) as carol:
            csrf = await sign_in(carol, api.tokens["carol"])
            assert approval["id"] in (await carol.get("/inbox")).text
            moved = await carol.post(
                f"/inbox/approvals/{approval['id']}/decision",
                json=decision(
                    approval,
                    arguments={"tenant_id": "acme", "ticket_id": "T-9", "fields": {"p": "1"}},
                ),
                headers={"X-CSRF-Token": csrf},
            )
            assert moved.status_code == 403, moved.text
            assert moved.json()["code"] == "tenant_not_allowed"
            assert (await pending_approval(api, started["run_id"], who="carol"))["status"] == (
                "pending"
            )


async def test_no_page_shows_a_secret_argument(tmp_path) -> None:
    """A comment's body is not a safe field: the inbox shows it redacted, and
    the run page's transcript redacts it even where the seat quoted it."""
    secret = "s3cret-body-value-4711"
    call = ticket_call("ticket_comment", "T-3", body=secret)
    said = {
        "turns": [
            {
                "seat": "seat-1",
                "round": 1,
                "text": f"Posting {secret!r} now",
                "tool_calls": [call],
            }
        ],
        "final": "done",
    }
    async with harness(tmp_path) as h, serve_api(h) as api:
        started = await start(api, script=said)
        approval = await pending_approval(api, started["run_id"])
        async with browser(api) as ops:
            await sign_in(ops, api.tokens["ops"])
            inbox = (await ops.get("/inbox")).text
            assert approval["id"] in inbox and "[redacted]" in inbox
            page = (await ops.get(f"/inbox/runs/{started['run_id']}")).text
            assert "Posting" in page and "[redacted]" in page
            form = (await ops.get(f"/inbox/approvals/{approval['id']}/edit")).json()
            assert form["redacted"] == ["body"]
            for text in (inbox, page, json.dumps(form)):
                assert secret not in text


async def test_the_inbox_extends_then_decides(tmp_path) -> None:
    """The inbox calls the API's own routes in Python: an extension and a
    decision made there are applied, and the deadline moves once."""
    async with harness(tmp_path) as h, serve_api(h) as api:
        started = await start(api, approval_timeout_seconds=600)
        approval = await pending_approval(api, started["run_id"])
        async with browser(api) as alice:
            ok = {"X-CSRF-Token": await sign_in(alice, api.tokens["alice"])}
            extended = await alice.post(
                f"/inbox/approvals/{approval['id']}/extend", json={"seconds": 60}, headers=ok
            )
            assert extended.status_code == 200, extended.text
            assert extended.json()["expires_at"] > approval["expires_at"]
            decided = await alice.post(
                f"/inbox/approvals/{approval['id']}/decision", json=decision(approval), headers=ok
            )
            assert decided.status_code == 200, decided.text
            assert decided.json()["status"] == "approved"
