"""/v1/approvals: what waits for a person, and their decision."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Header, Response
from pydantic import BaseModel, ConfigDict, Field, model_validator

from api.auth import Caller, Context, Principal
from api.context import ApiContext
from api.openapi import AUTHENTICATED, problems
from api.pagination import DEFAULT_LIMIT, Cursor, Limit, after_time, page
from api.problems import Problem
from api.schemas import ApprovalPage, ApprovalView, DecisionResult, ExtendResult
from roundtable import operations
from roundtable.store import ApprovalStatus, NotFoundError
from roundtable.views import approval_pair_view, approval_view

router = APIRouter(
    prefix="/v1/approvals",
    tags=["approvals"],
    dependencies=AUTHENTICATED,
    responses=problems(401, 422),
)


# The caller's name for a decision or extension: sent again with the same
# body, the request is answered as the first was (operations.idempotent_request_id).
IdempotencyKey = Annotated[str | None, Header(min_length=1, max_length=255)]


class DecisionBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    decision: Literal["approved", "rejected"]
    reason: str | None = Field(default=None, max_length=2000)
    arguments_digest: str = Field(
        min_length=1,
        max_length=80,
        description="The arguments_digest of the approval as you read it.",
    )
    arguments: dict[str, Any] | None = Field(
        default=None,
        description="Approve with edits: the corrected full arguments (approvals only).",
    )

    @model_validator(mode="after")
    def _edits_only_when_approving(self) -> DecisionBody:
        if self.arguments is not None and self.decision != "approved":
            raise ValueError("arguments: edits come only with decision 'approved'")
        return self


async def visible_approval(
    ctx: ApiContext, caller: Principal, approval_id: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The approval and its run; 404 unless the caller may see it. (The
    inbox's pages use it too: one rule for the API and the page.)"""
    try:
        approval = await ctx.store.get_approval(approval_id)
        run = await ctx.store.get_run(approval["run_id"])
    except NotFoundError:
        approval = run = None
    if approval is None or not caller.may_see(run["user_id"]):
        raise Problem(404, "not_found", f"approval {approval_id!r} not found")
    return approval, run


async def decidable_approval(
    ctx: ApiContext, caller: Principal, approval_id: str, verb: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The approval and its run; 404 unless the caller may see it, 403 unless
    the caller may act on it."""
    approval, run = await visible_approval(ctx, caller, approval_id)
    if not caller.may_decide(run["user_id"]):
        raise Problem(403, "forbidden", f"a {caller.role} token cannot {verb} approvals")
    return approval, run


@router.get("", response_model=ApprovalPage)
async def list_approvals(
    caller: Caller,
    ctx: Context,
    status: ApprovalStatus | None = None,
    limit: Limit = DEFAULT_LIMIT,
    cursor: Cursor = None,
) -> dict[str, Any]:
    """Oldest first, ``limit`` at a time, like ``/v1/runs``: pass a page's
    ``next_cursor`` back as ``cursor``. One query whatever the page size."""
    pairs = await ctx.store.approvals_with_actions(
        user_id=None if caller.sees_everything else caller.user_id,
        status=status,
        limit=limit,
        after=after_time(cursor),
    )
    last = (pairs[-1][0]["created_at"], pairs[-1][0]["id"]) if pairs else None
    return page([approval_pair_view(*p) for p in pairs], limit, last)


@router.get("/{approval_id}", response_model=ApprovalView, responses=problems(404))
async def get_approval(approval_id: str, caller: Caller, ctx: Context) -> dict[str, Any]:
    approval, _ = await visible_approval(ctx, caller, approval_id)
    return await approval_view(ctx.store, approval)


@router.post(
    "/{approval_id}/decision",
    response_model=DecisionResult,
    responses=problems(400, 403, 404, 409, 413, 503),
)
async def decide(
    approval_id: str,
    body: DecisionBody,
    caller: Caller,
    ctx: Context,
    response: Response,
    idempotency_key: IdempotencyKey = None,
) -> dict[str, Any]:
    """Approve or reject, bound to the arguments you saw. 409 when the approval
    is no longer pending or the arguments changed; the decider is the token's owner.
    A POST sent again with the same ``Idempotency-Key`` and body (its answer
    lost) is answered as the first was, and decides nothing again."""
    await decidable_approval(ctx, caller, approval_id, "decide")
    decided = await operations.decide(
        await ctx.temporal(),
        ctx.store,
        approval_id,
        body.decision,
        caller.user_id,
        body.reason,
        body.arguments_digest,
        body.arguments,
        decider=caller.decider(),
        idempotency_key=idempotency_key,
    )
    return _replayed_if(decided, response)


class ExtendBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    seconds: int = Field(gt=0, description="How much longer the approval stays open.")


@router.post(
    "/{approval_id}/extend",
    response_model=ExtendResult,
    responses=problems(400, 403, 404, 409, 413, 503),
)
async def extend(
    approval_id: str,
    body: ExtendBody,
    caller: Caller,
    ctx: Context,
    response: Response,
    idempotency_key: IdempotencyKey = None,
) -> dict[str, Any]:
    """Give people more time to decide; bounded by the server's maximum. A
    POST sent again with the same ``Idempotency-Key`` and body is answered
    as the first was: the deadline moves once."""
    await decidable_approval(ctx, caller, approval_id, "extend")
    extended = await operations.extend(
        await ctx.temporal(),
        ctx.store,
        approval_id,
        body.seconds,
        caller.user_id,
        ctx.settings.max_approval_extension_seconds,
        max_extensions=ctx.settings.max_approval_extensions,
        max_total_seconds=ctx.settings.max_approval_total_seconds,
        decider=caller.decider(),
        idempotency_key=idempotency_key,
    )
    return _replayed_if(extended, response)


def _replayed_if(answer: dict[str, Any], response: Response) -> dict[str, Any]:
    """``Idempotent-Replayed: true`` when the answer is a request's recorded
    one, as for a run started again under its key."""
    if answer.pop("replayed"):
        response.headers["Idempotent-Replayed"] = "true"
    return answer
