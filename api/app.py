"""The FastAPI application (OpenAPI docs at /docs)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from temporalio.client import Client

from api import access_log, problems
from api.context import ApiContext
from api.docs import install_docs
from api.inbox import router as inbox_router
from api.metrics import ApiMetrics, CountRequests
from api.openapi import install_openapi
from api.routes import actions, approvals, codec, health, metrics, runs, webhooks
from roundtable.codec import EncryptionCodec, keys_from_environment
from roundtable.config import Settings, load_settings
from roundtable.store import Store, open_store
from roundtable.telemetry.tracing import instrument_api, start_tracing
from roundtable.temporal import temporal_connection

MAX_BODY_BYTES = 256 * 1024


class NotForTheInbox(CORSMiddleware):
    """The Temporal UI's CORS grant (its origins, with credentials), for
    everything but the inbox. The UI's origin is same-site with the API (the
    same host on another port), so a browser sends it the inbox's
    SameSite=Strict cookie: with the grant, a script there could read the
    inbox's pages, and the CSRF token in them. The inbox is same-origin only."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if path == "/inbox" or path.startswith("/inbox/"):
            await self.app(scope, receive, send)
            return
        await super().__call__(scope, receive, send)


# Past the limit, up to this much more of a body is read and dropped, so the
# connection can carry the client's next request; a larger one is closed.
DRAIN_BYTES = 1024 * 1024


class BodyLimit:
    """Refuse request bodies over the limit (413) without keeping them.

    The rest of a refused body is read and dropped before answering: left
    unread, the server stops reading the connection and the client's next
    request on it hangs (schemathesis found this). Bodies too large even to
    drain are answered with ``Connection: close``."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._refuse(receive, send, more=True)
            return
        seen, answered = 0, False

        async def counted() -> Message:
            # Over the limit: answer 413 ourselves and tell the app the client
            # left (FastAPI turns any error raised while reading into a 400).
            nonlocal seen, answered
            if answered:
                return {"type": "http.disconnect"}
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                answered = True
                await self._refuse(receive, send, more=message.get("more_body", False))
                return {"type": "http.disconnect"}
            return message

        async def unless_answered(message: Message) -> None:
            if not answered:
                await send(message)

        await self.app(scope, counted, unless_answered)

    async def _refuse(self, receive: Receive, send: Send, more: bool) -> None:
        drained = 0
        while more and drained <= DRAIN_BYTES:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            drained += len(message.get("body", b""))
            more = message.get("more_body", False)
        await _too_large(self.limit, send, close=more)


async def _too_large(limit: int, send: Send, close: bool) -> None:
    response = problems.problem_response(
        413, "payload_too_large", f"request bodies are limited to {limit} bytes"
    )
    if close:  # the rest of the body is still on its way: this connection is done
        response.headers["Connection"] = "close"
    await response({"type": "http"}, _nothing, send)


async def _nothing() -> Message:
    return {"type": "http.disconnect"}


def create_app(
    settings: Settings | None = None,
    store: Store | None = None,
    client: Client | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    tracing: bool | None = None,
) -> FastAPI:
    """The app. Tests hand in a store and a client; ``roundtable api`` opens its own.
    ``tracing``: spans for requests and Temporal calls (default: when the
    OpenTelemetry variables ask for it)."""
    settings = settings or load_settings()
    if client is None:
        # The client connects on first use; settings that cannot work stop
        # the API now, by name, not at its first request.
        temporal_connection(settings)
    traced = start_tracing("roundtable-api") if tracing is None else tracing

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if store is not None:
            app.state.context = ApiContext(settings, store, client, traced)
            yield
            return
        async with open_store(settings.database_url, pool=settings.database_pool()) as opened:
            app.state.context = ApiContext(settings, opened, client, traced)
            yield

    app = FastAPI(
        title="Roundtable API",
        version="1",
        description="Runs of LLM agents whose writes are approved, leased and audited.",
        lifespan=lifespan,
        docs_url=None,  # served by api/docs.py from local assets
        redoc_url=None,
    )
    problems.install(app)
    access_log.install()
    install_docs(app)
    install_openapi(app)
    for module in (runs, approvals, actions, health, codec, webhooks, metrics):
        app.include_router(module.router)
    # The approvals inbox (issue 15): HTML pages, not part of the OpenAPI document.
    app.include_router(inbox_router)
    app.state.metrics = ApiMetrics()
    app.state.codec = EncryptionCodec(keys_from_environment())
    # The Temporal UI calls the codec endpoints from the browser.
    app.add_middleware(
        NotForTheInbox,
        allow_origins=settings.ui_origins,
        allow_methods=["POST", "OPTIONS"],
        allow_headers=["Authorization", "Content-Type", "X-Namespace"],
        allow_credentials=True,
    )
    app.add_middleware(BodyLimit, limit=max_body_bytes)
    # Outermost: counts every request, refused ones included.
    app.add_middleware(CountRequests, metrics=app.state.metrics)
    if traced:
        instrument_api(app)
    return app


def app_factory() -> Any:  # for `uvicorn --factory api.app:app_factory`
    return create_app()
