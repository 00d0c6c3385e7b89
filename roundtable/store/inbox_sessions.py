"""Inbox sessions (issue 15): a browser signed in with an API token.

The session id is a random secret handed to the browser once, in a cookie;
only its SHA-256 is stored. The CSRF token is an HMAC of the session id, so
it is bound to the session and never stored. A session is good until it
expires, is revoked (sign-out), or the API token it was opened with is
revoked: every lookup checks the token again.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from datetime import timedelta
from typing import Any

from sqlalchemy import select

from roundtable.completion import complete_every_public_coroutine
from roundtable.store.database import Database
from roundtable.store.engine import database_now
from roundtable.store.rows import row_to_dict
from roundtable.store.schema import ApiTokenRow, InboxSessionRow

SESSION_PREFIX = "rts_"  # the visible prefix of every session id


def hash_session_id(session_id: str) -> str:
    return hashlib.sha256(session_id.encode()).hexdigest()


def csrf_token(session_id: str) -> str:
    """The CSRF token of a session: derived from its secret id, never stored."""
    return hmac.new(session_id.encode(), b"roundtable-inbox-csrf", hashlib.sha256).hexdigest()


def csrf_matches(session_id: str, offered: str | None) -> bool:
    """In constant time; as bytes, since compare_digest refuses (raises on) a
    str that is not ASCII, and the offered token is whatever a client sent."""
    if not offered:
        return False
    expected = csrf_token(session_id).encode()
    return hmac.compare_digest(expected, offered.encode("utf-8", "surrogatepass"))


@complete_every_public_coroutine
class InboxSessions:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def open(self, token_id: str, user_id: str, lifetime: timedelta) -> str:
        """A new session for an authenticated token: its plain id (kept by no one here)."""
        session_id = SESSION_PREFIX + secrets.token_urlsafe(32)
        async with self.db.transaction() as session:
            now = await database_now(session)
            session.add(
                InboxSessionRow(
                    id_hash=hash_session_id(session_id),
                    token_id=token_id,
                    user_id=user_id,
                    created_at=now,
                    expires_at=now + lifetime,
                )
            )
        return session_id

    async def lookup(self, session_id: str) -> dict[str, Any] | None:
        """The session's token record (user, role, tenants), or None when the
        session is unknown, expired, signed out, or its token revoked."""
        if not session_id.startswith(SESSION_PREFIX):
            return None
        async with self.db.reader() as session:
            now = await database_now(session)
            found = (
                await session.execute(
                    select(InboxSessionRow, ApiTokenRow)
                    .join(ApiTokenRow, ApiTokenRow.id == InboxSessionRow.token_id)
                    .where(InboxSessionRow.id_hash == hash_session_id(session_id))
                )
            ).first()
        if found is None:
            return None
        row, token = found
        if row.revoked_at is not None or token.revoked_at is not None or row.expires_at <= now:
            return None
        record = row_to_dict(token)
        record.pop("token_hash")
        return record

    async def revoke(self, session_id: str) -> bool:
        """Sign out: the session is good for nothing from now on."""
        async with self.db.transaction() as session:
            row = await session.get(InboxSessionRow, hash_session_id(session_id))
            if row is None or row.revoked_at is not None:
                return False
            row.revoked_at = await database_now(session)
            return True
