"""Errors as RFC 9457 problem documents with a stable ``code``, mapped once."""

from __future__ import annotations

import math
from datetime import UTC, datetime
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from roundtable.operations import TemporalUnavailableError
from roundtable.store import (
    AttemptMayBeRunningError,
    ConflictError,
    ForbiddenError,
    InvalidInputError,
    NotFoundError,
)

PROBLEM = "application/problem+json"


class Problem(Exception):
    def __init__(self, status: int, code: str, detail: str, **extra: Any) -> None:
        super().__init__(detail)
        self.status, self.code, self.detail, self.extra = status, code, detail, extra


def problem_response(status: int, code: str, detail: str, **extra: Any) -> JSONResponse:
    body = {
        "type": f"https://roundtable.dev/problems/{code}",
        "title": code.replace("_", " "),
        "status": status,
        "code": code,
        "detail": detail,
        **extra,
    }
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(body, status_code=status, media_type=PROBLEM, headers=headers)


def _field(location: tuple) -> str:
    parts = [str(p) for p in location if p not in ("body", "query", "path", "header")]
    return ".".join(parts) or "body"


def install(app: FastAPI) -> None:
    @app.exception_handler(Problem)
    async def _problem(_: Request, exc: Problem) -> JSONResponse:
        return problem_response(exc.status, exc.code, exc.detail, **exc.extra)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [{"field": _field(e["loc"]), "message": e["msg"]} for e in exc.errors()]
        detail = "; ".join(f"{e['field']}: {e['message']}" for e in errors)
        return problem_response(422, "validation_error", detail, errors=errors)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed", 413: "payload_too_large"}.get(
            exc.status_code, "http_error"
        )
        response = problem_response(exc.status_code, code, str(exc.detail))
        # Keep what Starlette says with it, e.g. a 405's Allow (RFC 9110).
        response.headers.update(exc.headers or {})
        if exc.status_code == 405:
            # Starlette names only the first route that matched the path;
            # Allow lists every method the resource has.
            response.headers["Allow"] = ", ".join(_methods_of(request))
        return response

    @app.exception_handler(NotFoundError)
    async def _not_found(_: Request, exc: NotFoundError) -> JSONResponse:
        return problem_response(404, "not_found", str(exc))

    @app.exception_handler(ConflictError)
    async def _conflict(_: Request, exc: ConflictError) -> JSONResponse:
        return problem_response(409, "conflict", str(exc))

    @app.exception_handler(AttemptMayBeRunningError)
    async def _maybe_running(_: Request, exc: AttemptMayBeRunningError) -> JSONResponse:
        response = problem_response(409, exc.code, str(exc), retry_at=exc.retry_at.isoformat())
        wait = (exc.retry_at - datetime.now(UTC)).total_seconds()
        response.headers["Retry-After"] = str(max(1, math.ceil(wait)))
        return response

    @app.exception_handler(InvalidInputError)
    async def _bad_input(_: Request, exc: InvalidInputError) -> JSONResponse:
        if exc.field is None:
            return problem_response(422, exc.code, str(exc))
        errors = [{"field": exc.field, "message": str(exc)}]
        return problem_response(422, exc.code, str(exc), errors=errors)

    @app.exception_handler(ForbiddenError)
    async def _forbidden(_: Request, exc: ForbiddenError) -> JSONResponse:
        return problem_response(403, exc.code, str(exc))

    @app.exception_handler(TemporalUnavailableError)
    async def _unavailable(_: Request, exc: TemporalUnavailableError) -> JSONResponse:
        return problem_response(503, exc.code, str(exc))


def _methods_of(request: Request) -> list[str]:
    """Every method some route answers at this path (routers included)."""
    allowed = []
    for method in ("DELETE", "GET", "HEAD", "PATCH", "POST", "PUT"):
        scope = {**request.scope, "method": method}
        if any(route.matches(scope)[0] == Match.FULL for route in request.app.router.routes):
            allowed.append(method)
    return allowed
