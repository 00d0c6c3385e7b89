"""Bearer-token authentication and who may see what.

Users see and decide their own runs; operators see and decide all and
reconcile; services start runs for a user and read runs; the codec credential
only encodes and decodes payloads (for the Temporal UI). Another user's run
is reported as missing (404), never as forbidden, so ids do not leak.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from api.context import ApiContext, context
from api.problems import Problem
from roundtable.permissions import Decider


@dataclass(frozen=True)
class Principal:
    user_id: str
    role: str
    tenants: tuple[str, ...] | None = None  # None: every tenant

    @property
    def sees_everything(self) -> bool:
        return self.role in ("operator", "service")

    def may_see(self, owner: str) -> bool:
        return self.sees_everything or owner == self.user_id

    def may_decide(self, owner: str) -> bool:
        # Separation of duties and risk are checked again where the decision
        # lands (roundtable/permissions.py): this is only who may try.
        return self.role == "operator" or (self.role == "user" and owner == self.user_id)

    def decider(self) -> Decider:
        return Decider(user_id=self.user_id, role=self.role, tenants=self.tenants)


async def authenticated(token: str, ctx: ApiContext) -> Principal:
    record = await ctx.store.authenticate_token(token.strip())
    if record is None:
        raise Problem(401, "unauthorized", "unknown or revoked token")
    tenants = record.get("tenants")
    return Principal(
        user_id=record["user_id"],
        role=record["role"],
        tenants=tuple(tenants) if tenants is not None else None,
    )


async def _bearer(request: Request, ctx: ApiContext) -> Principal:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Problem(401, "unauthorized", "send Authorization: Bearer <token>")
    return await authenticated(token, ctx)


async def principal(request: Request, ctx: Annotated[ApiContext, Depends(context)]) -> Principal:
    """Anyone with a token, except the codec credential, which may do nothing
    but encode and decode payloads."""
    caller = await _bearer(request, ctx)
    if caller.role == "codec":
        raise Problem(403, "forbidden", "a codec token may only encode and decode payloads")
    return caller


async def codec_principal(
    request: Request, ctx: Annotated[ApiContext, Depends(context)]
) -> Principal:
    caller = await _bearer(request, ctx)
    require_codec_role(caller)
    return caller


def require_codec_role(caller: Principal) -> None:
    if caller.role not in ("codec", "operator"):
        raise Problem(403, "forbidden", "the codec endpoints need a codec or operator token")


Caller = Annotated[Principal, Depends(principal)]
CodecCaller = Annotated[Principal, Depends(codec_principal)]
Context = Annotated[ApiContext, Depends(context)]
