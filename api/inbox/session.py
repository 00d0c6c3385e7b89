"""Who is signed in to the inbox, and the CSRF check on every POST."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from urllib.parse import urlsplit

from fastapi import Request, Response

from api.auth import Principal, authenticated
from api.context import ApiContext
from api.problems import Problem
from roundtable.store.inbox_sessions import csrf_matches, csrf_token

COOKIE = "rt_inbox"
PATH = "/inbox"
CSRF_HEADER = "x-csrf-token"
CSRF_FIELD = "csrf_token"


@dataclass(frozen=True)
class Signed:
    principal: Principal
    session_id: str  # the cookie's secret: never logged, never stored plain

    @property
    def csrf(self) -> str:
        return csrf_token(self.session_id)


def _principal(record: dict) -> Principal:
    tenants = record.get("tenants")
    return Principal(
        user_id=record["user_id"],
        role=record["role"],
        tenants=tuple(tenants) if tenants is not None else None,
    )


async def sign_in(ctx: ApiContext, token: str) -> tuple[Principal, str]:
    """The API's own token check (401 for an unknown or revoked token); the
    codec credential may not sign in. Returns the principal and a new session id."""
    principal = await authenticated(token, ctx)
    if principal.role == "codec":
        raise Problem(403, "forbidden", "a codec token may only encode and decode payloads")
    record = await ctx.store.authenticate_token(token.strip())
    assert record is not None  # authenticated() just found it
    session_id = await ctx.store.open_inbox_session(
        record["id"], record["user_id"], timedelta(seconds=ctx.settings.inbox_session_seconds)
    )
    return principal, session_id


async def signed_in(request: Request, ctx: ApiContext) -> Signed | None:
    session_id = request.cookies.get(COOKIE, "")
    if not session_id:
        return None
    record = await ctx.store.inbox_session(session_id)
    if record is None or record["role"] == "codec":
        return None
    return Signed(_principal(record), session_id)


def set_cookie(response: Response, ctx: ApiContext, session_id: str) -> None:
    response.set_cookie(
        COOKIE,
        session_id,
        max_age=ctx.settings.inbox_session_seconds,
        path=PATH,
        httponly=True,
        samesite="strict",
        secure=ctx.settings.inbox_cookie_secure,
    )


def clear_cookie(response: Response, ctx: ApiContext) -> None:
    response.delete_cookie(
        COOKIE,
        path=PATH,
        httponly=True,
        samesite="strict",
        secure=ctx.settings.inbox_cookie_secure,
    )


def same_origin(request: Request) -> bool:
    """A POST from this site. A browser names the page a POST came from
    (Origin; else Referer), and says whether it is cross-site (Sec-Fetch-Site):
    whatever it names must be this server. (None of them: a non-browser
    client, which a CSRF attack cannot be.)"""
    if request.headers.get("sec-fetch-site", "same-origin") not in ("same-origin", "none"):
        return False
    origin = request.headers.get("origin")
    if origin is None:
        referer = request.headers.get("referer")
        if referer is None:
            return True
        origin = referer
    if origin == "null":
        return False
    host = request.headers.get("host", "")
    return urlsplit(origin).netloc == host


async def require_post(request: Request, ctx: ApiContext, offered: str | None) -> Signed:
    """Every state-changing request: a live session (401), from this site,
    with the session's CSRF token (403)."""
    signed = await signed_in(request, ctx)
    if signed is None:
        raise Problem(401, "unauthorized", "sign in at /inbox/login first")
    if not same_origin(request):
        raise Problem(403, "csrf_refused", "cross-site request refused")
    if not csrf_matches(signed.session_id, offered or request.headers.get(CSRF_HEADER)):
        raise Problem(403, "csrf_refused", "missing or wrong CSRF token")
    return signed
