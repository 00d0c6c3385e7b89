"""The real API app served by uvicorn on a loopback port, in front of the harness."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import uvicorn

from api.app import create_app
from roundtable.config import Settings
from roundtable.ports import free_port
from tests.workflow_harness import Harness


@dataclass
class Api:
    http: httpx.AsyncClient
    tokens: dict[str, str]  # name → bearer token

    def auth(self, who: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.tokens[who]}"}


@asynccontextmanager
async def serving(app: Any) -> AsyncIterator[int]:
    """Serve an ASGI app with uvicorn on a free loopback port until the block ends."""
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    )
    task = asyncio.create_task(server.serve())
    for _ in range(500):
        if server.started:
            break
        await asyncio.sleep(0.02)
    assert server.started, "uvicorn did not start"
    try:
        yield port
    finally:
        server.should_exit = True
        await task


@asynccontextmanager
async def serve_api(
    h: Harness, max_body_bytes: int = 256 * 1024, tracing: bool = False, **settings: Any
) -> AsyncIterator[Api]:
    """``settings``: the API's own (ceilings, approvers, …), by field name."""
    config = Settings(database_url="sqlite+aiosqlite://", task_queue=h.task_queue, **settings)
    app = create_app(
        config, store=h.store, client=h.client, max_body_bytes=max_body_bytes, tracing=tracing
    )
    tokens = {}
    for name, role in (
        ("alice", "user"),
        ("bob", "user"),
        ("ops", "operator"),
        ("svc", "service"),
        ("ui", "codec"),
    ):
        tokens[name], _ = await h.store.create_token(user_id=name, role=role)
    # A user who may act for one tenant only.
    tokens["carol"], _ = await h.store.create_token(
        user_id="carol", role="user", tenants=["initech"]
    )
    async with (
        serving(app) as port,
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as http,
    ):
        yield Api(http, tokens)
