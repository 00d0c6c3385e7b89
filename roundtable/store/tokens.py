"""API bearer tokens: created once (the plain token is returned only then),
stored as a hash, listed without secrets, revoked for good."""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Iterable
from typing import Any

from sqlalchemy import select

from roundtable.completion import complete_every_public_coroutine
from roundtable.store.database import Database
from roundtable.store.engine import database_now
from roundtable.store.errors import ConflictError, InvalidInputError, NotFoundError
from roundtable.store.rows import new_id, require_text, row_to_dict
from roundtable.store.schema import ApiTokenRow

# codec: may only encode and decode payloads (the Temporal UI's credential).
ROLES = ("user", "operator", "service", "codec")
TOKEN_PREFIX = "rt_"  # noqa: S105 (the visible prefix of every token, not a secret)


def normalize_tenants(tenants: Iterable[str] | None) -> list[str] | None:
    if tenants is None:
        return None
    cleaned = sorted({t.strip() for t in tenants if t.strip()})
    for tenant in cleaned:
        if len(tenant) > 128 or not tenant.isprintable():
            raise InvalidInputError(f"tenant {tenant[:40]!r} is not a valid tenant id")
    if not cleaned:
        raise InvalidInputError("tenants: name at least one tenant, or leave it out for all")
    return cleaned


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _public(row: ApiTokenRow) -> dict[str, Any]:
    view = row_to_dict(row)
    view.pop("token_hash")
    return view


@complete_every_public_coroutine
class Tokens:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def create(
        self,
        *,
        user_id: str,
        role: str,
        label: str | None = None,
        tenants: Iterable[str] | None = None,
    ) -> tuple[str, dict[str, Any]]:
        """A new token: ``(plain_token, record)``. The plain token is not kept.
        ``tenants``: the only tenants a user token's runs may write to and its
        holder may approve writes for (None: every tenant)."""
        require_text("user_id", user_id)
        if role not in ROLES:
            raise InvalidInputError(f"role must be one of {', '.join(ROLES)}")
        tenants = normalize_tenants(tenants)
        if tenants is not None and role != "user":
            raise InvalidInputError("only user tokens are limited to tenants")
        token = TOKEN_PREFIX + secrets.token_urlsafe(32)
        async with self.db.transaction() as session:
            row = ApiTokenRow(
                id=new_id(),
                token_hash=hash_token(token),
                token_prefix=token[:10],
                user_id=user_id,
                role=role,
                label=label,
                tenants=tenants,
                created_at=await database_now(session),
            )
            session.add(row)
        return token, _public(row)

    async def list(self) -> list[dict[str, Any]]:
        async with self.db.reader() as session:
            rows = await session.execute(select(ApiTokenRow).order_by(ApiTokenRow.created_at))
            return [_public(row) for row in rows.scalars()]

    async def revoke(self, token_id: str) -> dict[str, Any]:
        async with self.db.transaction() as session:
            row = await session.get(ApiTokenRow, token_id)
            if row is None:
                raise NotFoundError(f"token {token_id!r} not found")
            if row.revoked_at is not None:
                raise ConflictError(f"token {token_id!r} is already revoked")
            row.revoked_at = await database_now(session)
        return _public(row)

    async def authenticate(self, token: str) -> dict[str, Any] | None:
        """The token's owner and role, or None for an unknown or revoked token."""
        if not token.startswith(TOKEN_PREFIX):
            return None
        async with self.db.reader() as session:
            row = (
                await session.execute(
                    select(ApiTokenRow).where(ApiTokenRow.token_hash == hash_token(token))
                )
            ).scalar_one_or_none()
        if row is None or row.revoked_at is not None:
            return None
        return _public(row)
