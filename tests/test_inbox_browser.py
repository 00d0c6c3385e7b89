"""The approvals inbox in a real browser (issue 15): headless Chromium
(Debian's) through Playwright, against the real API over HTTP, a real worker
and a real Temporal dev server. One stack for the module. Screenshots of the
inbox and the run page go to test-artifacts/."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from tests.api_server import Api, serve_api
from tests.browser import ARTIFACTS, CHROMIUM, FLAGS, require_browser
from tests.conftest import TEST_SECRET
from tests.dev_stack import dev_stack
from tests.test_api import finished, pending_approval, start
from tests.workflow_harness import Harness, harness, script, ticket_call

pytestmark = pytest.mark.asyncio(loop_scope="module")

WAIT_MS = 30_000


@dataclass
class Stack:
    h: Harness
    api: Api
    browser: Any
    base: str

    async def sign_in(self, who: str, viewport: dict | None = None) -> tuple[Any, Any]:
        """A fresh browser context signed in as ``who``, by keyboard alone."""
        context = await self.browser.new_context(
            base_url=self.base, viewport=viewport or {"width": 1280, "height": 1000}
        )
        page = await context.new_page()
        await page.goto("/inbox/login")
        await page.locator('input[name="token"]').focus()
        await page.keyboard.type(self.api.tokens[who])
        await page.keyboard.press("Enter")
        await page.wait_for_url(f"{self.base}/inbox", timeout=WAIT_MS)
        return context, page

    async def run(self, ticket: str, who: str = "alice", **body: Any) -> tuple[str, dict]:
        """A run whose one write (an update of ``ticket``) waits for approval."""
        fields = body.pop("fields", {"priority": "high"})
        calls = [ticket_call("ticket_update", ticket, fields=fields)]
        started = await start(
            self.api, who, script=script(("seat-1", 1, calls)), task_text=f"Fix {ticket}", **body
        )
        return started["run_id"], await pending_approval(self.api, started["run_id"], who)

    async def writes(self, ticket: str) -> list[dict]:
        return [w for w in await self.h.tickets.write_log() if w["ticket_id"] == ticket]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Stack]:
    require_browser()
    tmp = tmp_path_factory.mktemp("inbox")
    with pytest.MonkeyPatch.context() as env:  # the autouse secret is per test; this is per module
        env.setenv("ROUNDTABLE_ACTION_SECRET_KEY", TEST_SECRET)
        async with _stack(tmp) as made:
            yield made


@asynccontextmanager
async def _stack(tmp: Path) -> AsyncIterator[Stack]:
    from playwright.async_api import async_playwright

    async with (
        harness(tmp, dev_server=True) as h,
        serve_api(h) as api,
        async_playwright() as playwright,
    ):
        browser = await playwright.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        try:
            yield Stack(h, api, browser, str(api.http.base_url).rstrip("/"))
        finally:
            await browser.close()


def entry(page: Any, approval_id: str) -> Any:
    return page.locator(f'article[data-approval-id="{approval_id}"]')


async def test_a_pending_approval_appears_and_approving_it_writes(stack: Stack) -> None:
    context, page = await stack.sign_in("ops")
    try:
        run_id, approval = await stack.run("T-101")  # after the page opened: it must appear
        item = entry(page, approval["id"])
        await item.wait_for(timeout=WAIT_MS)
        assert "ticket_update" in await item.inner_text()
        assert "seat-1" in await item.inner_text() and "Fix T-101" in await item.inner_text()
        assert "risk R2" in await item.inner_text()
        await page.wait_for_function(
            "document.querySelector('time.countdown').textContent.includes('expires in')"
        )
        ARTIFACTS.mkdir(exist_ok=True)
        await page.screenshot(path=str(ARTIFACTS / "inbox.png"), full_page=True)

        # By keyboard: focus the button, press Enter.
        await item.locator('[data-action="approve"]').focus()
        await page.keyboard.press("Enter")
        await item.locator(".outcome").filter(has_text="Approved").wait_for(timeout=WAIT_MS)
        await item.wait_for(state="detached", timeout=WAIT_MS)  # it leaves without a reload
        run = await finished(stack.api, run_id)
        assert run["status"] == "completed" and run["approvals"][0]["decided_by"] == "ops"
        (write,) = await stack.writes("T-101")
        assert write["outcome"] == "applied", write

        await page.goto(f"/inbox/runs/{run_id}")
        assert await page.locator('[data-chain="verified"]').is_visible()
        assert await page.locator(".run-status").inner_text() == "completed"
        assert await page.locator(".fencing-token").first.inner_text() == str(
            write["fencing_token"]
        )
        assert "seat-1 speaks in round 1" in await page.locator(".transcript").inner_text()
        await page.screenshot(path=str(ARTIFACTS / "inbox-run.png"), full_page=True)
    finally:
        await context.close()


async def test_reject_with_a_reason(stack: Stack) -> None:
    context, page = await stack.sign_in("ops")
    try:
        run_id, approval = await stack.run("T-102")
        item = entry(page, approval["id"])
        await item.wait_for(timeout=WAIT_MS)
        await item.locator('[data-action="reject"]').click()  # no reason yet: not sent
        await item.locator(".outcome").filter(has_text="reason").wait_for()
        await item.locator('[data-field="reason"]').fill("wrong ticket, ask the customer")
        await item.locator('[data-action="reject"]').click()
        await item.locator(".outcome").filter(has_text="Rejected").wait_for(timeout=WAIT_MS)
        run = await finished(stack.api, run_id)
        assert run["approvals"][0]["status"] == "rejected"
        assert run["approvals"][0]["decision_reason"] == "wrong ticket, ask the customer"
        assert await stack.writes("T-102") == []
    finally:
        await context.close()


async def test_edit_arguments_invalid_refused_in_page_valid_runs(stack: Stack) -> None:
    context, page = await stack.sign_in("ops")
    try:
        run_id, approval = await stack.run("T-103")
        item = entry(page, approval["id"])
        await item.wait_for(timeout=WAIT_MS)
        await item.locator('[data-action="edit"]').click()
        fields = item.locator('textarea[data-name="fields"]')
        await fields.wait_for(timeout=WAIT_MS)
        assert json.loads(await fields.input_value()) == {"priority": "high"}

        sent: list[str] = []
        page.on("request", lambda r: sent.append(r.url) if r.method == "POST" else None)
        await fields.fill("{}")  # the schema wants at least one field
        await item.locator('[data-action="review-edit"]').click()
        errors = item.locator(".edit-errors")
        await errors.filter(has_text="fields").wait_for()
        assert "at least 1" in await errors.inner_text()
        assert await item.locator('[data-action="submit-edit"]').is_disabled()
        assert sent == []  # refused in the page: nothing went to the server
        assert (await pending_approval(stack.api, run_id))["status"] == "pending"

        await fields.fill('{"priority": "low", "owner": "dana"}')
        await item.locator('[data-action="review-edit"]').click()
        diff = item.locator(".edit-diff table")
        await diff.wait_for()
        assert "fields" in await diff.inner_text() and "dana" in await diff.inner_text()
        await page.screenshot(path=str(ARTIFACTS / "inbox-edit.png"), full_page=True)
        await item.locator('[data-action="submit-edit"]').click()
        await item.locator(".outcome").filter(has_text="with your edits").wait_for(timeout=WAIT_MS)
        run = await finished(stack.api, run_id)
        assert run["status"] == "completed"
        assert (await stack.h.tickets.read("acme", "T-103"))["fields"] == {
            "priority": "low",
            "owner": "dana",
        }
    finally:
        await context.close()


async def test_expiry_and_lost_races_change_nothing(stack: Stack) -> None:
    context, live = await stack.sign_in("ops")
    stale = await context.new_page()  # a page that stopped hearing the live list
    await stale.route("**/inbox/events", lambda route: route.abort())
    try:
        run_id, approval = await stack.run("T-104", approval_timeout_seconds=6)
        await entry(live, approval["id"]).wait_for(timeout=WAIT_MS)
        await stale.goto("/inbox")
        old = entry(stale, approval["id"])
        await old.wait_for(timeout=WAIT_MS)
        # It expires while the page is open: the countdown runs out, the entry leaves.
        await entry(live, approval["id"]).wait_for(state="detached", timeout=WAIT_MS)
        assert (await finished(stack.api, run_id))["approvals"][0]["status"] == "expired"
        await old.locator('[data-action="approve"]').click()
        said = old.locator(".outcome")
        await said.filter(has_text="nothing changed").wait_for(timeout=WAIT_MS)
        assert "expired" in await said.inner_text()
        assert await stack.writes("T-104") == []

        # Decided elsewhere (by its owner, through the API) while the page showed it.
        run_id, approval = await stack.run("T-105")
        await stale.goto("/inbox")
        old = entry(stale, approval["id"])
        await old.wait_for(timeout=WAIT_MS)
        decided = await stack.api.http.post(
            f"/v1/approvals/{approval['id']}/decision",
            headers=stack.api.auth("alice"),
            json={"decision": "approved", "arguments_digest": approval["arguments_digest"]},
        )
        assert decided.status_code == 200
        await old.locator('[data-field="reason"]').fill("no")
        await old.locator('[data-action="reject"]').click()
        said = old.locator(".outcome")
        await said.filter(has_text="nothing changed").wait_for(timeout=WAIT_MS)
        assert "already approved" in await said.inner_text()
        run = await finished(stack.api, run_id)
        assert run["approvals"][0]["status"] == "approved"
        assert run["approvals"][0]["decided_by"] == "alice"
    finally:
        await context.close()


async def unknown_action(stack: Stack, ticket: str) -> tuple[str, str]:
    """A run whose approved write applied, then its answer was lost: unknown."""
    stack.h.tickets.drop_after_write = frozenset({ticket})
    run_id, approval = await stack.run(ticket)
    decided = await stack.api.http.post(
        f"/v1/approvals/{approval['id']}/decision",
        headers=stack.api.auth("alice"),
        json={"decision": "approved", "arguments_digest": approval["arguments_digest"]},
    )
    assert decided.status_code == 200
    for _ in range(300):
        run = (await stack.api.http.get(f"/v1/runs/{run_id}", headers=stack.api.auth("ops"))).json()
        if run["actions"] and run["actions"][0]["status"] == "unknown":
            return run_id, run["actions"][0]["id"]
        await asyncio.sleep(0.1)
    raise AssertionError(f"no unknown action: {run}")


async def test_reconcile_an_unknown_action(stack: Stack) -> None:
    run_id, action_id = await unknown_action(stack, "T-113")
    context, page = await stack.sign_in("ops")
    try:
        await page.goto("/inbox/unknown")
        item = page.locator(f'article[data-action-id="{action_id}"]')
        await item.wait_for(timeout=WAIT_MS)
        shown = await item.inner_text()
        assert "ticket_update" in shown and "Attempt started" in shown
        assert "connection dropped" in await item.locator(".last-error").inner_text()
        await page.screenshot(path=str(ARTIFACTS / "inbox-unknown.png"), full_page=True)
        await item.get_by_label("It succeeded").check()
        await item.get_by_label("Note (what you checked)").fill("T-113 shows the new priority")
        await item.locator('[data-action="reconcile"]').click()
        await item.locator(".outcome").filter(has_text="Reconciled as").wait_for(timeout=WAIT_MS)
        run = (await stack.api.http.get(f"/v1/runs/{run_id}", headers=stack.api.auth("ops"))).json()
        assert run["actions"][0]["status"] == "succeeded"
        await page.reload()
        assert await page.locator(f'article[data-action-id="{action_id}"]').count() == 0
    finally:
        stack.h.tickets.drop_after_write = frozenset()
        await context.close()


async def test_another_user_sees_none_of_it(stack: Stack) -> None:
    ops_context, ops = await stack.sign_in("ops")
    bob_context, bob = await stack.sign_in("bob")
    try:
        run_id, approval = await stack.run("T-106")
        await entry(ops, approval["id"]).wait_for(timeout=WAIT_MS)
        await bob.reload()
        assert await bob.locator("article[data-approval-id]").count() == 0
        assert await bob.locator("p.empty").is_visible()
        await bob.goto("/inbox/unknown")
        assert await bob.locator("article").count() == 0
        answer = await bob.goto(f"/inbox/runs/{run_id}")
        assert answer.status == 404 and "Fix T-106" not in await bob.content()
    finally:
        await bob_context.close()
        await ops_context.close()


async def test_a_cross_site_post_without_the_csrf_token_is_refused(stack: Stack) -> None:
    context, page = await stack.sign_in("ops")
    try:
        run_id, approval = await stack.run("T-107")
        target = f"{stack.base}/inbox/approvals/{approval['id']}/decision"
        forged = f"""<!doctype html><form id="f" method="post" action="{target}">
<input name="decision" value="approved">
<input name="arguments_digest" value="{approval["arguments_digest"]}">
</form><script>document.getElementById("f").submit()</script>"""
        await page.route(
            "http://evil.test/**",
            lambda route: route.fulfill(body=forged, content_type="text/html"),
        )
        async with page.expect_response(lambda r: r.url == target) as answer:
            await page.goto("http://evil.test/")
        assert (await answer.value).status in (401, 403)
        assert (await pending_approval(stack.api, run_id))["status"] == "pending"
        assert await stack.writes("T-107") == []
    finally:
        await context.close()


async def test_readable_at_200_percent_zoom(stack: Stack) -> None:
    """A 1280-pixel window at 200 %: the page is 640 CSS pixels wide and must
    not need sideways scrolling."""
    context, page = await stack.sign_in("ops", viewport={"width": 640, "height": 900})
    try:
        _, approval = await stack.run("T-108")
        await entry(page, approval["id"]).wait_for(timeout=WAIT_MS)
        overflow = await page.evaluate(
            "document.documentElement.scrollWidth - document.documentElement.clientWidth"
        )
        assert overflow <= 0
        await page.screenshot(path=str(ARTIFACTS / "inbox-zoom-200.png"), full_page=True)
    finally:
        await context.close()


async def test_the_demo_of_make_run_is_decided_from_the_inbox(stack: Stack, tmp_path: Path) -> None:
    """`make run` (roundtable dev --demo): the inbox URL it prints, signed in
    with the operator token it wrote, decides the demo's two approvals."""
    with dev_stack(tmp_path) as dev:
        ((inbox, token_file),) = await asyncio.to_thread(
            dev.wait_for, r"Inbox: (http://\S+/inbox) .* \(paste the contents of (\S+)\)"
        )
        await asyncio.to_thread(dev.wait_for, r"waiting for approval", 2)
        token = (tmp_path / token_file).read_text().strip()
        context = await stack.browser.new_context(viewport={"width": 1280, "height": 1000})
        try:
            page = await context.new_page()
            await page.goto(f"{inbox}/login")
            await page.locator('input[name="token"]').fill(token)
            await page.get_by_role("button", name="Sign in").click()
            await page.wait_for_url(inbox, timeout=WAIT_MS)
            entries = page.locator("article[data-approval-id]")
            await page.wait_for_function(
                "document.querySelectorAll('article[data-approval-id]').length === 2",
                timeout=WAIT_MS,
            )
            assert "Triage ticket acme/T-100" in await entries.first.inner_text()
            await page.screenshot(path=str(ARTIFACTS / "inbox-demo.png"), full_page=True)
            for _ in range(2):
                first = entry(page, await entries.first.get_attribute("data-approval-id"))
                await first.locator('[data-action="approve"]').click()
                await (
                    first.locator(".outcome").filter(has_text="Approved").wait_for(timeout=WAIT_MS)
                )
                await first.wait_for(state="detached", timeout=WAIT_MS)
            await asyncio.to_thread(dev.wait_for, r"run demo-\S+ completed", 1, 120)
        finally:
            await context.close()


async def test_an_edit_against_a_schema_whose_pattern_only_python_reads(stack: Stack) -> None:
    """A tool schema's ``pattern`` is a Python (MCP server's) regex; one the
    browser cannot compile (a named group ``(?P<…>)``) must not break the edit
    form: the page leaves that check to the server, which makes it."""
    from api.inbox import routes

    real = routes._tool_schema

    async def python_only(ctx: Any, run_id: str, tool_name: str) -> dict[str, Any]:
        schema = json.loads(json.dumps(await real(ctx, run_id, tool_name)))
        schema["properties"]["ticket_id"]["pattern"] = "^(?P<prefix>T)-[0-9]+$"
        return schema

    context, page = await stack.sign_in("ops")
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(routes, "_tool_schema", python_only)
            run_id, approval = await stack.run("T-109")
            item = entry(page, approval["id"])
            await item.wait_for(timeout=WAIT_MS)
            await item.locator('[data-action="edit"]').click()
            fields = item.locator('textarea[data-name="fields"]')
            await fields.wait_for(timeout=WAIT_MS)
            await fields.fill('{"priority": "low"}')
            await item.locator('[data-action="review-edit"]').click()
            await item.locator(".edit-diff table").wait_for(timeout=WAIT_MS)
            await item.locator('[data-action="submit-edit"]').click()
            await (
                item.locator(".outcome")
                .filter(has_text="with your edits")
                .wait_for(timeout=WAIT_MS)
            )
        assert (await finished(stack.api, run_id))["status"] == "completed"
    finally:
        await context.close()


async def test_the_outcome_shows_even_when_the_live_list_drops_the_entry_first(
    stack: Stack,
) -> None:
    """The live list drops an approval the moment it is no longer pending,
    which can be before the decision's own answer reaches the page (a slow
    answer, a busy server): the person must still read what happened."""
    from api.routes import approvals

    real = approvals.decide

    async def slow_answer(*args: Any, **kwargs: Any) -> dict[str, Any]:
        done = await real(*args, **kwargs)
        await asyncio.sleep(3)  # the live list (polled every second) sees it first
        return done

    context, page = await stack.sign_in("ops")
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(approvals, "decide", slow_answer)
            run_id, approval = await stack.run("T-110")
            item = entry(page, approval["id"])
            await item.wait_for(timeout=WAIT_MS)
            await item.locator('[data-action="approve"]').click()
            await item.locator(".outcome").filter(has_text="Approved").wait_for(timeout=WAIT_MS)
        await item.wait_for(state="detached", timeout=WAIT_MS)
        assert (await finished(stack.api, run_id))["status"] == "completed"
    finally:
        await context.close()
