"""The OpenAPI document says what the API does: the bearer scheme (so /docs
has an Authorize button), and every error as an ``application/problem+json``
problem document."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Security
from fastapi.openapi.utils import get_openapi
from fastapi.params import Depends
from fastapi.security import HTTPBearer

from api.problems import PROBLEM
from api.schemas import ProblemDocument

# auto_error=False: api/auth.py answers a missing or bad token with our own
# 401 problem document; this dependency only declares the scheme.
bearer = HTTPBearer(
    auto_error=False,
    scheme_name="bearer",
    description="An API token (`roundtable token create`), sent as `Authorization: Bearer …`.",
)
AUTHENTICATED: list[Depends] = [Security(bearer)]

_WHY = {
    400: "The body could not be read as JSON at all.",
    401: "No token, or an unknown or revoked one.",
    403: "The token's role may not do this.",
    404: "No such resource, or not yours (ids do not leak).",
    409: "The resource is not in a state that allows this (see detail).",
    413: "The request body is over the size limit.",
    422: "The input is invalid; errors name the fields.",
    503: "Temporal cannot be reached; nothing was done.",
}


def problems(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` entries for these statuses, each a problem document."""
    return {status: {"model": ProblemDocument, "description": _WHY[status]} for status in statuses}


def install_openapi(app: FastAPI) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(
            title=app.title,
            version=app.version,
            description=app.description,
            routes=app.routes,
        )
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        # FastAPI files every declared model under application/json; errors
        # are sent as application/problem+json, so the document says that.
        for operations in schema.get("paths", {}).values():
            for operation in operations.values():
                # Hand-declared bodies (openapi_extra) bring their own $defs.
                for body in operation.get("requestBody", {}).get("content", {}).values():
                    components.update(body.get("schema", {}).pop("$defs", {}))
                for status, response in operation.get("responses", {}).items():
                    content = response.get("content", {})
                    if status[:1] in ("4", "5") and "application/json" in content:
                        content[PROBLEM] = content.pop("application/json")
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
