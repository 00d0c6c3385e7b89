"""/v1/webhook-deliveries: what each receiver was sent and answered (operators)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query

from api.auth import Caller, Context
from api.problems import Problem

router = APIRouter(prefix="/v1/webhook-deliveries", tags=["webhooks"])


@router.get("")
async def deliveries(
    caller: Caller, ctx: Context, run_id: Annotated[str | None, Query(max_length=64)] = None
) -> list[dict[str, Any]]:
    if caller.role != "operator":
        raise Problem(403, "forbidden", "the delivery log is for operators")
    rows = await ctx.store.list_webhook_deliveries(run_id=run_id)
    return [{**row, "created_at": row["created_at"].isoformat()} for row in rows]
