"""``GET /metrics``: Prometheus text. It takes an operator (or service) token
unless ``ROUNDTABLE_API_METRICS_PUBLIC`` is set; counts of pending work are
not secrets, but the route also tells who is using the API how."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST

from api.auth import Context, principal
from api.problems import Problem

router = APIRouter()


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request, ctx: Context) -> Response:
    if not ctx.settings.api_metrics_public:
        caller = await principal(request, ctx)
        if not caller.sees_everything:
            raise Problem(403, "forbidden", "metrics are for operator and service tokens")
    body = await request.app.state.metrics.render(ctx.store)
    return Response(body, media_type=CONTENT_TYPE_LATEST)
