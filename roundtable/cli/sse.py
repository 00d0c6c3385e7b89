"""Server-Sent Events read from a stream of lines (the WHATWG event-stream format)."""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass


@dataclass(frozen=True)
class ServerEvent:
    id: str | None
    event: str
    data: str


async def server_events(lines: AsyncIterable[str]) -> AsyncIterator[ServerEvent]:
    """Each event as its blank line ends it; comments (keep-alives) skipped."""
    data: list[str] = []
    event, last_id = "message", None
    async for line in lines:
        if not line:
            if data:
                yield ServerEvent(last_id, event, "\n".join(data))
            data, event = [], "message"
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "data":
            data.append(value)
        elif name == "event":
            event = value
        elif name == "id" and "\0" not in value:
            last_id = value
