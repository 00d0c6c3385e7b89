"""The API's Prometheus metrics: its requests, and the gauges from the database.

The worker serves its metrics through the Temporal SDK's runtime; the API is
no worker, so it renders its own with prometheus_client, one registry per app.
Gauges are counted in the database at scrape time (the same counts the
worker's gauges show), so every API replica reports the same values.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from roundtable.store import Store
from roundtable.telemetry.metrics import APPROVALS_PENDING, UNKNOWN_ACTIONS

_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
HTTP_REQUESTS_TOTAL = "roundtable_http_requests_total"
HTTP_REQUEST_SECONDS = "roundtable_http_request_seconds"


class ApiMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        # prometheus_client adds "_total" to counters itself.
        self.requests = Counter(
            HTTP_REQUESTS_TOTAL.removesuffix("_total"),
            "HTTP requests, by route template and status.",
            ["method", "route", "status"],
            registry=self.registry,
        )
        self.seconds = Histogram(
            HTTP_REQUEST_SECONDS,
            "HTTP request duration, by route template.",
            ["method", "route"],
            registry=self.registry,
        )
        self.pending = Gauge(
            APPROVALS_PENDING, "Approvals waiting for a person.", registry=self.registry
        )
        self.unknown = Gauge(
            UNKNOWN_ACTIONS,
            "Actions whose outcome is unknown, waiting for reconciliation.",
            registry=self.registry,
        )

    async def render(self, store: Store) -> bytes:
        pending, unknown = await store.open_work()
        self.pending.set(pending)
        self.unknown.set(unknown)
        return generate_latest(self.registry)


class CountRequests:
    """ASGI middleware: one count and one duration per HTTP request, labelled
    by the route's template (``/v1/runs/{run_id}``), never the raw path, so ids
    and tokens in paths neither leak nor multiply the series."""

    def __init__(self, app: ASGIApp, metrics: ApiMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        began = time.monotonic()
        status = 500

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            # Any client may send any method name: only the standard ones are labels.
            method = scope.get("method", "")
            method = method if method in _METHODS else "other"
            self.metrics.requests.labels(method, route, str(status)).inc()
            self.metrics.seconds.labels(method, route).observe(time.monotonic() - began)
