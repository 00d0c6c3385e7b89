"""A local stand-in for an OpenAI-compatible endpoint, speaking the real
chat-completions wire format over real HTTP. Each test scripts the replies."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from tests.api_server import serving

Reply = dict[str, Any]  # {"status", "body", "delay", "after"}
Script = Callable[[dict[str, Any], int], Reply]  # (request body, call number) -> reply


def message(
    text: str = "", calls: list[tuple[str, Any]] | None = None, usage: tuple[int, int] = (11, 7)
) -> Reply:
    """A 200 completion: text and tool calls; a call's arguments may be a str
    (sent as is, e.g. broken JSON) or anything JSON-serialisable."""
    tool_calls = [
        {
            "id": f"call_{uuid.uuid4().hex[:8]}",
            "type": "function",
            "function": {
                "name": name,
                "arguments": args if isinstance(args, str) else json.dumps(args),
            },
        }
        for name, args in calls or []
    ]
    body = {
        "id": f"chatcmpl-{uuid.uuid4().hex[:8]}",
        "object": "chat.completion",
        "created": 0,
        "model": "fake",
        "choices": [
            {
                "index": 0,
                "finish_reason": "tool_calls" if tool_calls else "stop",
                "message": {
                    "role": "assistant",
                    "content": text or None,
                    "tool_calls": tool_calls or None,
                },
            }
        ],
        "usage": {
            "prompt_tokens": usage[0],
            "completion_tokens": usage[1],
            "total_tokens": sum(usage),
        },
    }
    return {"status": 200, "body": body}


def error(status: int, delay: float = 0.0) -> Reply:
    return {
        "status": status,
        "delay": delay,
        "body": {"error": {"message": f"fake {status}", "type": "fake", "code": None}},
    }


@dataclass
class FakeOpenAI:
    base_url: str
    script: Script
    requests: list[dict[str, Any]] = field(default_factory=list)

    def for_seat(self, seat: str) -> list[dict[str, Any]]:
        return [r for r in self.requests if f"You are {seat}" in r["messages"][0]["content"]]


@asynccontextmanager
async def fake_openai(script: Script) -> AsyncIterator[FakeOpenAI]:
    requests: list[dict[str, Any]] = []

    async def completions(request: Request) -> JSONResponse:
        body = await request.json()
        requests.append(body)
        reply = script(body, len(requests))
        if reply.get("after"):  # a coroutine function: reply once something has happened
            await reply["after"]()
        if reply.get("delay"):
            await asyncio.sleep(reply["delay"])
        return JSONResponse(reply["body"], status_code=reply["status"])

    app = Starlette(routes=[Route("/v1/chat/completions", completions, methods=["POST"])])
    async with serving(app) as port:
        yield FakeOpenAI(f"http://127.0.0.1:{port}/v1", script, requests)
