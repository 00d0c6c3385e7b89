"""Liveness and readiness."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from sqlalchemy import text

from api.auth import Context
from api.schemas import Health, Readiness

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health)
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get(
    "/readyz",
    response_model=Readiness,
    responses={503: {"model": Readiness, "description": "Not ready: see checks."}},
)
async def readyz(ctx: Context) -> dict[str, Any] | JSONResponse:
    checks: dict[str, str] = {}
    try:
        async with ctx.store.engine.connect() as connection:
            await connection.execute(text("SELECT 1"))
        checks["database"] = "ok"
    except Exception as exc:
        checks["database"] = f"unavailable: {type(exc).__name__}"
    try:
        await (await ctx.temporal()).service_client.check_health()
        checks["temporal"] = "ok"
    except Exception as exc:
        checks["temporal"] = f"unavailable: {type(exc).__name__}"
    ready = all(v == "ok" for v in checks.values())
    body = {"status": "ready" if ready else "not_ready", "checks": checks}
    return body if ready else JSONResponse(body, status_code=503)
