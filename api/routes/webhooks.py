"""/v1/webhook-deliveries: what each receiver was sent and answered (operators)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query

from api.auth import Caller, Context
from api.openapi import AUTHENTICATED, problems
from api.pagination import DEFAULT_LIMIT, Cursor, Limit, after_number, page
from api.problems import Problem
from api.schemas import WebhookDeliveryPage

router = APIRouter(
    prefix="/v1/webhook-deliveries",
    tags=["webhooks"],
    dependencies=AUTHENTICATED,
    responses=problems(401, 422),
)


@router.get("", response_model=WebhookDeliveryPage, responses=problems(403))
async def deliveries(
    caller: Caller,
    ctx: Context,
    run_id: Annotated[str | None, Query(max_length=64)] = None,
    limit: Limit = DEFAULT_LIMIT,
    cursor: Cursor = None,
) -> dict[str, Any]:
    """Attempts in the order they were made, ``limit`` at a time, like
    ``/v1/runs``: pass a page's ``next_cursor`` back as ``cursor``."""
    if caller.role != "operator":
        raise Problem(403, "forbidden", "the delivery log is for operators")
    rows = await ctx.store.webhook_deliveries_page(
        run_id=run_id, after_id=after_number(cursor), limit=limit
    )
    items = [{**row, "created_at": row["created_at"].isoformat()} for row in rows]
    return page(items, limit, (rows[-1]["id"],) if rows else None)
