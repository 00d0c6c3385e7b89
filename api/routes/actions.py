"""/v1/actions: reconciliation of unknown outcomes (operators only)."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from api.auth import Caller, Context
from api.openapi import AUTHENTICATED, problems
from api.problems import Problem
from api.schemas import ReconcileResult
from roundtable import operations
from roundtable.store import NotFoundError

router = APIRouter(
    prefix="/v1/actions",
    tags=["actions"],
    dependencies=AUTHENTICATED,
    responses=problems(401, 422),
)


class ReconcileBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    outcome: Literal["succeeded", "failed"]
    note: str = Field(min_length=1, max_length=2000)


@router.post(
    "/{action_id}/reconcile",
    response_model=ReconcileResult,
    responses=problems(400, 403, 404, 409, 413, 503),
)
async def reconcile(
    action_id: str, body: ReconcileBody, caller: Caller, ctx: Context
) -> dict[str, Any]:
    try:
        action = await ctx.store.get_action(action_id)
        owner = (await ctx.store.get_run(action["run_id"]))["user_id"]
    except NotFoundError:
        owner = None
    if owner is None or not caller.may_see(owner):
        raise Problem(404, "not_found", f"action {action_id!r} not found")
    if caller.role != "operator":
        raise Problem(403, "forbidden", "only operators reconcile")
    return await operations.reconcile(
        await ctx.temporal(),
        ctx.store,
        action_id,
        body.outcome,
        caller.user_id,
        body.note,
        ctx.settings.task_queue,
    )
