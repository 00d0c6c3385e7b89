"""Bearer-token authentication and who may see what.

Users see and decide their own runs; operators see and decide all and
reconcile; services start runs for a user and read runs. Another user's run
is reported as missing (404), never as forbidden, so ids do not leak.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from api.context import ApiContext, context
from api.problems import Problem


@dataclass(frozen=True)
class Principal:
    user_id: str
    role: str

    @property
    def sees_everything(self) -> bool:
        return self.role in ("operator", "service")

    def may_see(self, owner: str) -> bool:
        return self.sees_everything or owner == self.user_id

    def may_decide(self, owner: str) -> bool:
        return self.role == "operator" or (self.role == "user" and owner == self.user_id)


async def principal(request: Request, ctx: Annotated[ApiContext, Depends(context)]) -> Principal:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Problem(401, "unauthorized", "send Authorization: Bearer <token>")
    record = await ctx.store.authenticate_token(token.strip())
    if record is None:
        raise Problem(401, "unauthorized", "unknown or revoked token")
    return Principal(user_id=record["user_id"], role=record["role"])


Caller = Annotated[Principal, Depends(principal)]
Context = Annotated[ApiContext, Depends(context)]
