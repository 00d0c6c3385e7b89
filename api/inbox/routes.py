"""/inbox: the pages, the live list, and the decision POSTs (which call the
API's own route functions: one set of rules for the API and the page)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from datetime import timedelta
from importlib.resources import files
from typing import Annotated, Any

import jsonschema
from fastapi import APIRouter, Depends, Request
from fastapi.responses import (
    HTMLResponse,
    JSONResponse,
    RedirectResponse,
    Response,
    StreamingResponse,
)
from pydantic import BaseModel, ValidationError

from api.auth import Principal
from api.context import ApiContext, context
from api.inbox import render
from api.inbox.session import (
    COOKIE,
    CSRF_FIELD,
    Signed,
    clear_cookie,
    require_post,
    same_origin,
    set_cookie,
    sign_in,
    signed_in,
)
from api.keepalive import KeepAlive
from api.problems import Problem
from api.routes import actions as action_routes
from api.routes import approvals as approval_routes
from api.routes.runs import visible_run
from roundtable.models import RunState
from roundtable.names import STATE_QUERY
from roundtable.security import (
    REDACTED,
    ActionSecretKeyError,
    ArgumentsDecryptionError,
    action_to_public_dict,
    redact_text,
    text_redactor,
)
from roundtable.store import NotFoundError
from roundtable.views import approval_pair_view, event_view, run_view

router = APIRouter(prefix="/inbox", include_in_schema=False)
Ctx = Annotated[ApiContext, Depends(context)]

LIVE_POLL_SECONDS = 1.0
LIVE_KEEPALIVE_SECONDS = 15.0
STATE_QUERY_TIMEOUT = timedelta(seconds=5)
STATIC = {"inbox.js": "text/javascript", "inbox.css": "text/css"}
# Pages are never cached, never framed, and run only this server's script.
HEADERS = {
    "Cache-Control": "no-store",
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; "
        "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
}


def _html(body: str, status: int = 200) -> HTMLResponse:
    return HTMLResponse(body, status_code=status, headers=HEADERS)


def _to_login() -> RedirectResponse:
    return RedirectResponse("/inbox/login", status_code=303, headers=HEADERS)


# ------------------------------------------------------------------ sign-in


@router.get("/login")
async def login_page(request: Request, ctx: Ctx) -> Response:
    if await signed_in(request, ctx) is not None:
        return RedirectResponse("/inbox", status_code=303, headers=HEADERS)
    return _html(render.login())


@router.post("/login")
async def login(request: Request, ctx: Ctx) -> Response:
    if not same_origin(request):
        return _html(render.login("cross-site sign-in refused"), 403)
    form = await request.form()
    token = form.get("token")
    if not isinstance(token, str) or not token.strip():
        return _html(render.login("enter a token"), 400)
    try:
        _, session_id = await sign_in(ctx, token)
    except Problem as refused:
        return _html(render.login(refused.detail), refused.status)
    # The session this browser held (if any) ends: a new sign-in never leaves
    # an old session live behind the new cookie.
    held = request.cookies.get(COOKIE)
    if held:
        await ctx.store.revoke_inbox_session(held)
    response = RedirectResponse("/inbox", status_code=303, headers=HEADERS)
    set_cookie(response, ctx, session_id)
    return response


@router.post("/logout")
async def logout(request: Request, ctx: Ctx) -> Response:
    form = await request.form()
    offered = form.get(CSRF_FIELD)
    signed = await require_post(request, ctx, offered if isinstance(offered, str) else None)
    await ctx.store.revoke_inbox_session(signed.session_id)
    response = _to_login()
    clear_cookie(response, ctx)
    return response


# ------------------------------------------------------------------ pending approvals


class _Runs:
    """Runs and their task text, read once per render."""

    def __init__(self, ctx: ApiContext) -> None:
        self.ctx, self.runs, self.tasks = ctx, {}, {}

    async def run(self, run_id: str) -> dict[str, Any]:
        if run_id not in self.runs:
            self.runs[run_id] = await self.ctx.store.get_run(run_id)
        return self.runs[run_id]

    async def task(self, run_id: str) -> str | None:
        if run_id not in self.tasks:
            run = await self.run(run_id)
            try:
                self.tasks[run_id] = (await self.ctx.store.get_session(run["session_id"]))[
                    "task_text"
                ]
            except NotFoundError:
                self.tasks[run_id] = None
        return self.tasks[run_id]


async def _pending(ctx: ApiContext, signed: Signed) -> list[tuple[str, str, str]]:
    """(approval id, expires_at, entry HTML), most urgent first: exactly the
    pending approvals GET /v1/approvals shows this caller."""
    who = signed.principal
    pairs = await ctx.store.approvals_with_actions(
        user_id=None if who.sees_everything else who.user_id, status="pending"
    )
    runs = _Runs(ctx)
    entries = []
    for approval, action in sorted(pairs, key=lambda p: (p[0]["expires_at"], p[0]["id"])):
        view = approval_pair_view(approval, action)
        view["run_owner"] = (await runs.run(approval["run_id"]))["user_id"]
        html = render.approval_entry(
            view, await runs.task(approval["run_id"]), action["risk_level"], signed
        )
        entries.append((view["id"], view["expires_at"], html))
    return entries


@router.get("")
async def inbox(request: Request, ctx: Ctx) -> Response:
    signed = await signed_in(request, ctx)
    if signed is None:
        return _to_login()
    entries = await _pending(ctx, signed)
    return _html(render.page("Pending approvals", render.inbox([h for *_, h in entries]), signed))


@router.get("/events")
async def live(request: Request, ctx: Ctx) -> Response:
    """The pending list as it changes (server-sent events): each message has
    every pending id in order and each entry's HTML; the page adds the new,
    drops the gone and keeps what it has (a half-typed reason survives)."""
    signed = await signed_in(request, ctx)
    if signed is None:
        raise Problem(401, "unauthorized", "sign in at /inbox/login first")
    return StreamingResponse(
        _live(ctx, signed, request),
        media_type="text/event-stream",
        headers={**HEADERS, "X-Accel-Buffering": "no"},
    )


async def _live(ctx: ApiContext, signed: Signed, request: Request) -> AsyncIterator[str]:
    last: list[tuple[str, str]] | None = None
    keep_alive = KeepAlive(LIVE_POLL_SECONDS, LIVE_KEEPALIVE_SECONDS)
    while not await request.is_disconnected():
        if await ctx.store.inbox_session(signed.session_id) is None:
            yield "event: signed-out\ndata: {}\n\n"
            return
        entries = await _pending(ctx, signed)
        now = [(i, x) for i, x, _ in entries]
        changed = now != last
        if changed:
            last = now
            data = {"ids": [i for i, *_ in entries], "html": {i: h for i, _, h in entries}}
            yield f"event: pending\ndata: {json.dumps(data)}\n\n"
        if line := keep_alive.after_poll(sent=changed):
            yield line
        await asyncio.sleep(LIVE_POLL_SECONDS)


# ------------------------------------------------------------------ decisions


async def _body(request: Request, model: type[BaseModel]) -> Any:
    raw = await request.body()
    try:
        parsed = json.loads(raw or b"null")
    except (ValueError, RecursionError):  # not JSON, not UTF-8, or nested past the stack
        raise Problem(422, "validation_error", "send a JSON object") from None
    try:
        return model.model_validate(parsed)
    except ValidationError as exc:
        detail = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'body'}: {err['msg']}"
            for err in exc.errors()
        )
        raise Problem(422, "validation_error", detail or "send a JSON object") from None


async def _run_state(ctx: ApiContext, run_id: str) -> RunState | None:
    """The run's workflow's own view (snapshot, transcript), if it answers."""
    try:
        client = await ctx.temporal()
        return await client.get_workflow_handle(run_id).query(
            STATE_QUERY, result_type=RunState, rpc_timeout=STATE_QUERY_TIMEOUT
        )
    except Exception:
        return None


async def _tool_schema(ctx: ApiContext, run_id: str, tool_name: str) -> dict[str, Any]:
    """The JSON schema the run's pinned capability snapshot holds for the tool:
    the one the worker checks edits against."""
    state = await _run_state(ctx, run_id)
    spec = state.snapshot.tool(tool_name) if state and state.snapshot else None
    if spec is None:
        raise Problem(503, "temporal_unavailable", "the run's tool schema cannot be read now")
    return spec.parameters


def _edit_problems(schema: dict[str, Any], arguments: dict[str, Any]) -> list[dict[str, str]]:
    found = [
        {"field": name, "message": "a redacted value: enter the value itself"}
        for name, value in arguments.items()
        if value == REDACTED
    ]
    try:
        errors = list(jsonschema.Draft202012Validator(schema).iter_errors(arguments))
    except Exception as exc:  # the schema is an MCP server's word, never checked
        # A bad regex, an unresolvable (never fetched) $ref, a keyword of the
        # wrong type: the schema cannot check this edit, so it is refused.
        reason = f"{type(exc).__name__}: {exc}"[:200]
        return [{"field": "(arguments)", "message": f"the tool's schema is broken ({reason})"}]
    for error in sorted(errors, key=lambda e: list(e.path)):
        field = ".".join(str(p) for p in error.path) or "(arguments)"
        found.append({"field": field, "message": error.message})
    return found


@router.get("/approvals/{approval_id}/edit")
async def edit_form(approval_id: str, request: Request, ctx: Ctx) -> Response:
    """What the edit form is built from: the tool's schema and the public
    arguments (secret values redacted: the operator must enter them again)."""
    signed = await signed_in(request, ctx)
    if signed is None:
        raise Problem(401, "unauthorized", "sign in at /inbox/login first")
    await approval_routes.decidable_approval(ctx, signed.principal, approval_id, "decide")
    view = await approval_routes.get_approval(approval_id, signed.principal, ctx)
    schema = await _tool_schema(ctx, view["run_id"], view["tool_name"])
    arguments = view["arguments"] or {}
    form = {
        "tool_name": view["tool_name"],
        "schema": schema,
        "arguments": arguments,
        "redacted": [k for k, v in arguments.items() if v == REDACTED],
        "arguments_digest": view["arguments_digest"],
    }
    # Arguments and a digest: no cache keeps them after sign-out.
    return JSONResponse(form, headers={"Cache-Control": "no-store"})


@router.post("/approvals/{approval_id}/decision")
async def decide(approval_id: str, request: Request, ctx: Ctx) -> dict[str, Any]:
    signed = await require_post(request, ctx, None)
    body = await _body(request, approval_routes.DecisionBody)
    if body.arguments is not None:
        # Who may decide first: one who may not learns nothing from the edit check.
        approval, _ = await approval_routes.decidable_approval(
            ctx, signed.principal, approval_id, "decide"
        )
        tool = (await ctx.store.get_action(approval["action_id"]))["tool_name"]
        problems = _edit_problems(await _tool_schema(ctx, approval["run_id"], tool), body.arguments)
        if problems:
            detail = "; ".join(f"{p['field']}: {p['message']}" for p in problems)
            raise Problem(422, "invalid_input", detail, errors=problems)
    # The inbox's own answer carries no replay header: a browser's click is
    # sent once (its page re-reads the approval after).
    return await approval_routes.decide(
        approval_id, body, signed.principal, ctx, Response(), idempotency_key=None
    )


@router.post("/approvals/{approval_id}/extend")
async def extend(approval_id: str, request: Request, ctx: Ctx) -> dict[str, Any]:
    signed = await require_post(request, ctx, None)
    body = await _body(request, approval_routes.ExtendBody)
    return await approval_routes.extend(
        approval_id, body, signed.principal, ctx, Response(), idempotency_key=None
    )


@router.post("/actions/{action_id}/reconcile")
async def reconcile(action_id: str, request: Request, ctx: Ctx) -> dict[str, Any]:
    signed = await require_post(request, ctx, None)
    body = await _body(request, action_routes.ReconcileBody)
    return await action_routes.reconcile(action_id, body, signed.principal, ctx)


# ------------------------------------------------------------------ unknown actions


def _last_error(result: dict[str, Any] | None) -> str | None:
    if not result:
        return None
    for key in ("error", "message", "detail", "reason"):
        if result.get(key):
            return str(result[key])
    return json.dumps(result, sort_keys=True)


async def _shown_error(ctx: ApiContext, action: dict[str, Any], error: str | None) -> str | None:
    """The last error as the page shows it: redacted of the action's secret
    argument values (the result may hold what a late attempt reported: the
    tool's own result, quoting them), and bounded; withheld when the
    arguments cannot be read to redact it."""
    if error is None:
        return None
    try:
        arguments = await ctx.store.get_action_arguments(action["id"])
    except NotFoundError:
        arguments = {}
    except (ActionSecretKeyError, ArgumentsDecryptionError):
        return "[withheld: the arguments it might quote cannot be read to redact it]"
    return redact_text(error, arguments, action.get("safe_argument_fields"))


@router.get("/unknown")
async def unknown(request: Request, ctx: Ctx) -> Response:
    signed = await signed_in(request, ctx)
    if signed is None:
        return _to_login()
    who: Principal = signed.principal
    pairs = await ctx.store.unknown_actions(user_id=None if who.sees_everything else who.user_id)
    rows = []
    for action, _run in pairs:
        public = action_to_public_dict(action)
        target = action.get("target_scope") or action["target_key"]
        error = await _shown_error(ctx, action, _last_error(public["result"]))
        rows.append({"action": public, "target": target, "error": error})
    body = render.unknown(rows, operator=who.role == "operator")
    return _html(render.page("Unknown actions", body, signed))


# ------------------------------------------------------------------ a run


async def _written_secrets(ctx: ApiContext, actions: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The secret (not safe) argument values each of the run's writes holds
    now: with an operator's edits, which no seat's tool call carries. None
    when they cannot be read (no key, a different key): the transcript is
    then not shown at all, since nothing could be redacted from it."""
    secrets: dict[str, Any] = {}
    for action in actions:
        try:
            arguments = await ctx.store.get_action_arguments(action["id"])
        except NotFoundError:
            continue
        except (ActionSecretKeyError, ArgumentsDecryptionError):
            return None
        safe = set(action.get("safe_argument_fields") or ())
        for name, value in arguments.items():
            if name not in safe:
                secrets[f"{action['id']}:{name}"] = value
    return secrets


def _transcript(
    state: RunState | None, written: dict[str, Any] | None = None
) -> list[dict[str, Any]] | None:
    """What the seats said. Tool calls by name only (the actions table shows
    their arguments' public view), and every secret argument value any seat
    passed a tool, or a write ran with (``written``: an operator's edits), is
    redacted from the text, however escaped (``redact_text``, the rule error
    messages follow; it also bounds each message)."""
    if state is None:
        return None
    messages = [*state.transcript, *(m for thread in state.threads.values() for m in thread)]
    secrets: dict[str, Any] = dict(written or {})
    for message in messages:
        for call in message.tool_calls:
            spec = state.snapshot.tool(call.name) if state.snapshot else None
            safe = set(spec.safe_argument_fields) if spec else set()
            for name, value in call.arguments.items():
                if name not in safe:
                    secrets[f"{call.id}:{name}"] = value
    redact = text_redactor(secrets)  # the secrets' spellings, once for every message
    return [
        {
            "speaker": m.name or m.role,
            "text": redact(m.content),
            "calls": [c.name for c in m.tool_calls],
        }
        for m in state.transcript
        if m.role in ("assistant", "user")
    ]


@router.get("/runs/{run_id}")
async def run_page(run_id: str, request: Request, ctx: Ctx) -> Response:
    signed = await signed_in(request, ctx)
    if signed is None:
        return _to_login()
    try:
        run = await visible_run(ctx, signed.principal, run_id)
    except Problem:
        return _html(
            render.page("Run not found", "<p>No such run (or not yours).</p>", signed), 404
        )
    view = await run_view(ctx.store, run_id)
    snapshot = await ctx.store.run_snapshot(run_id)
    fencing = {a["id"]: a["fencing_token"] for a in snapshot["actions"]}
    try:
        task = (await ctx.store.get_session(run["session_id"]))["task_text"]
    except NotFoundError:
        task = None
    events = await ctx.store.list_events(run_id)
    written = await _written_secrets(ctx, snapshot["actions"])
    body = render.run_page(
        view,
        task,
        None if written is None else _transcript(await _run_state(ctx, run_id), written),
        fencing,
        [event_view(ev) for ev in events],
        await ctx.store.verify_audit_chain(run_id),
    )
    return _html(render.page(f"Run {run_id}", body, signed))


# ------------------------------------------------------------------ assets


@router.get("/static/{name}")
async def static(name: str) -> Response:
    if name not in STATIC:
        raise Problem(404, "not_found", f"no asset {name!r}")
    text = (files("api.inbox") / "static" / name).read_text(encoding="utf-8")
    return Response(
        text,
        media_type=STATIC[name],
        headers={"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"},
    )
