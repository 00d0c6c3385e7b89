"""/v1/webhook-deliveries: what each receiver was sent and answered (operators)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response

from api.auth import Caller, Context
from api.openapi import AUTHENTICATED, problems
from api.pagination import DEFAULT_LIMIT, Cursor, Limit, after_number, array_page
from api.problems import Problem
from api.schemas import WebhookDelivery

router = APIRouter(
    prefix="/v1/webhook-deliveries",
    tags=["webhooks"],
    dependencies=AUTHENTICATED,
    responses=problems(401, 422),
)


@router.get("", response_model=list[WebhookDelivery], responses=problems(403))
async def deliveries(
    caller: Caller,
    ctx: Context,
    request: Request,
    response: Response,
    run_id: Annotated[str | None, Query(max_length=64)] = None,
    limit: Limit = DEFAULT_LIMIT,
    cursor: Cursor = None,
) -> list[dict[str, Any]]:
    """Attempts in the order they were made, ``limit`` at a time (a full
    page's ``Next-Cursor`` header gives the next)."""
    if caller.role != "operator":
        raise Problem(403, "forbidden", "the delivery log is for operators")
    rows = await ctx.store.webhook_deliveries_page(
        run_id=run_id, after_id=after_number(cursor), limit=limit
    )
    items = [{**row, "created_at": row["created_at"].isoformat()} for row in rows]
    return array_page(response, request, items, limit, (rows[-1]["id"],) if rows else None)
