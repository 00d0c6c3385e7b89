"""/v1/runs: start runs, read them, follow their audit log (JSON or live SSE)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Header, Query, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from api.auth import Caller, Context, Principal
from api.context import ApiContext
from api.keepalive import KeepAlive
from api.openapi import AUTHENTICATED, problems
from api.pagination import (
    DEFAULT_LIMIT,
    MAX_LIMIT,
    Cursor,
    Limit,
    after_number,
    after_time,
    page,
)
from api.problems import Problem
from api.schemas import (
    ActionView,
    ApprovalView,
    EventPage,
    RecoverResult,
    RunPage,
    RunStarted,
    RunView,
)
from roundtable import operations, recovery
from roundtable.models import RunInput
from roundtable.store import FINAL_RUN_STATUSES, NotFoundError, RunStatus
from roundtable.views import approval_views, event_view, run_summary, run_view

router = APIRouter(
    prefix="/v1/runs",
    tags=["runs"],
    dependencies=AUTHENTICATED,
    responses=problems(401, 422),
)
SSE_POLL_SECONDS = 0.5
SSE_KEEPALIVE_SECONDS = 15.0


async def visible_run(ctx: ApiContext, caller: Principal, run_id: str) -> dict[str, Any]:
    try:
        run = await ctx.store.get_run(run_id)
    except NotFoundError:
        run = None
    if run is None or not caller.may_see(run["user_id"]):
        raise Problem(404, "not_found", f"run {run_id!r} not found")
    return run


@router.post(
    "",
    status_code=201,
    response_model=RunStarted,
    responses=problems(400, 403, 409, 413, 503),
)
async def start_run(
    request: RunInput,
    caller: Caller,
    ctx: Context,
    response: Response,
    idempotency_key: Annotated[str | None, Header(max_length=255)] = None,
) -> dict[str, Any]:
    """Start a run. A retried POST with the same ``Idempotency-Key`` returns the same run."""
    if caller.role == "service":
        if "user_id" not in request.model_fields_set:
            raise Problem(
                422,
                "validation_error",
                "user_id: required for service tokens",
                errors=[{"field": "user_id", "message": "required for service tokens"}],
            )
    elif "user_id" in request.model_fields_set and request.user_id != caller.user_id:
        raise Problem(403, "forbidden", "only service tokens start runs for another user")
    else:
        request = request.model_copy(update={"user_id": caller.user_id})
    if "run_id" in request.model_fields_set:
        raise Problem(
            422,
            "validation_error",
            "run_id: chosen by the server",
            errors=[{"field": "run_id", "message": "chosen by the server"}],
        )
    if idempotency_key:
        request = request.model_copy(
            update={"run_id": operations.idempotent_run_id(request.user_id, idempotency_key)}
        )
    started, created = await operations.start_run(
        await ctx.temporal(),
        ctx.store,
        request,
        ctx.settings.task_queue,
        authority=ctx.authority,
        role=caller.role,
        tenants=caller.tenants,
    )
    if not created:
        response.headers["Idempotent-Replayed"] = "true"
    return started


@router.get("", response_model=RunPage)
async def list_runs(
    caller: Caller,
    ctx: Context,
    status: RunStatus | None = None,
    user_id: Annotated[
        str | None, Query(max_length=255, description="Only this user's runs.")
    ] = None,
    limit: Limit = DEFAULT_LIMIT,
    cursor: Cursor = None,
) -> dict[str, Any]:
    """Oldest first. A caller who may see only their own runs sees only
    those, whichever ``user_id`` they ask for."""
    owner = user_id if caller.sees_everything else caller.user_id
    if user_id is not None and owner != user_id:
        return page([], limit, None)
    rows = await ctx.store.list_runs(
        user_id=owner,
        status=status,
        limit=limit,
        after=after_time(cursor),
    )
    items = [run_summary(r) for r in rows]
    return page(items, limit, (rows[-1]["created_at"], rows[-1]["id"]) if rows else None)


@router.get("/{run_id}", response_model=RunView, responses=problems(404))
async def get_run(run_id: str, caller: Caller, ctx: Context) -> dict[str, Any]:
    await visible_run(ctx, caller, run_id)
    return await run_view(ctx.store, run_id)


class RecoverBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    note: str = Field(
        min_length=1, max_length=recovery.MAX_NOTE, description="Why (kept in the audit log)."
    )


@router.post(
    "/{run_id}/recover",
    response_model=RecoverResult,
    responses=problems(400, 403, 404, 409, 413, 503),
)
async def recover_run(
    run_id: str, body: RecoverBody, caller: Caller, ctx: Context
) -> dict[str, Any]:
    """Reset a stalled run (its workflow tasks fail because its history holds
    commands this code does not make) to the first task a replay fails at.
    409 if the run has ended, is not stalled by a nondeterminism, or is being
    recovered; 503 if Temporal is unavailable or did not say whether it reset
    the run. Operators only; audited."""
    await visible_run(ctx, caller, run_id)
    if caller.role != "operator":
        raise Problem(403, "forbidden", "only operators recover runs")
    return await recovery.recover_run(
        await ctx.temporal(), ctx.store, run_id, caller.user_id, body.note
    )


@router.get("/{run_id}/actions", response_model=list[ActionView], responses=problems(404))
async def run_actions(run_id: str, caller: Caller, ctx: Context) -> list[dict[str, Any]]:
    await visible_run(ctx, caller, run_id)
    return (await run_view(ctx.store, run_id))["actions"]


@router.get("/{run_id}/approvals", response_model=list[ApprovalView], responses=problems(404))
async def run_approvals(run_id: str, caller: Caller, ctx: Context) -> list[dict[str, Any]]:
    await visible_run(ctx, caller, run_id)
    return await approval_views(ctx.store, run_id=run_id)


@router.get(
    "/{run_id}/events",
    response_model=EventPage,
    responses={
        **problems(404),
        200: {
            "description": "The audit log; with Accept: text/event-stream, live events.",
            "content": {"text/event-stream": {"schema": {"type": "string"}}},
        },
    },
)
async def run_events(
    run_id: str,
    caller: Caller,
    ctx: Context,
    request: Request,
    response: Response,
    last_event_id: Annotated[str | None, Header()] = None,
    limit: Limit = MAX_LIMIT,
    cursor: Cursor = None,
) -> dict[str, Any] | StreamingResponse:
    """The audit log, ``limit`` events at a time, like ``/v1/runs`` (pass a
    page's ``next_cursor`` back as ``cursor``). With ``Accept: text/event-stream`` it streams live,
    from ``Last-Event-ID`` on, until the run has finished."""
    await visible_run(ctx, caller, run_id)
    if "text/event-stream" not in request.headers.get("accept", ""):
        events = await ctx.store.events_page(run_id, after_seq=after_number(cursor), limit=limit)
        last = (events[-1]["seq"],) if events else None
        return page([event_view(e) for e in events], limit, last)
    # Only a sequence number we could have sent ("²".isdigit() is True, too).
    start = int(last_event_id) if last_event_id and _plain_number(last_event_id) else 0
    return StreamingResponse(
        _stream(ctx, run_id, start, request),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def _stream(ctx: ApiContext, run_id: str, seen: int, request: Request) -> AsyncIterator[str]:
    keep_alive = KeepAlive(SSE_POLL_SECONDS, SSE_KEEPALIVE_SECONDS)
    while not await request.is_disconnected():
        # The status before the events: a run's last events commit with its
        # final status, so once it reads final the read after has them all
        # (read the other way round, the stream could end one commit short).
        ended = (await ctx.store.get_run(run_id))["status"] in FINAL_RUN_STATUSES
        fresh = await ctx.store.events_page(run_id, after_seq=seen, limit=MAX_LIMIT)
        for event in fresh:
            seen = event["seq"]
            yield (
                f"id: {event['seq']}\nevent: {event['event_type']}\n"
                f"data: {json.dumps(event_view(event))}\n\n"
            )
        if not fresh and ended:
            return
        if line := keep_alive.after_poll(sent=bool(fresh)):
            yield line
        await asyncio.sleep(SSE_POLL_SECONDS)


def _plain_number(value: str) -> bool:
    return value.isascii() and value.isdigit() and len(value) <= 18
