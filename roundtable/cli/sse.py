"""Server-Sent Events read from a stream of bytes (the WHATWG event-stream
format), holding no more than ``limit`` bytes of one line or one event: a
server that never ends a line, or an event, is refused, not buffered."""

from __future__ import annotations

import io
import re
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass

_LINE_END = re.compile(rb"\r\n|\r|\n")


class TooLong(ValueError):
    """A line or an event longer than the reader's limit."""


@dataclass(frozen=True)
class ServerEvent:
    id: str | None
    event: str
    data: str


async def stream_lines(chunks: AsyncIterable[bytes], limit: int) -> AsyncIterator[str]:
    """Lines as the format ends them (CRLF, LF or CR), decoded as UTF-8; a
    line of more than ``limit`` bytes raises TooLong as soon as it is seen to be."""
    held = bytearray()
    after_cr = False  # a CR ended the last chunk: a LF opening the next is the same line end
    async for chunk in chunks:
        start = 1 if after_cr and chunk.startswith(b"\n") else 0
        after_cr = False
        for end in _LINE_END.finditer(chunk, start):
            if len(held) + end.start() - start > limit:
                raise TooLong(f"a line of more than {limit} bytes")
            held += chunk[start : end.start()]
            yield held.decode("utf-8", errors="replace")
            held.clear()
            start = end.end()
            after_cr = end.group() == b"\r" and start == len(chunk)
        held += chunk[start:]
        if len(held) > limit:
            raise TooLong(f"a line of more than {limit} bytes")
    # A line the stream ended without ending is dropped, as the format says.


async def server_events(lines: AsyncIterable[str], limit: int) -> AsyncIterator[ServerEvent]:
    """Each event as its blank line ends it; comments (keep-alives) skipped.
    An event whose data lines come to more than ``limit`` characters (the
    lines whole, as sent) raises TooLong."""
    data, size, event, last_id = io.StringIO(), 0, "message", None
    async for line in lines:
        if not line:
            if size:
                yield ServerEvent(last_id, event, data.getvalue().removesuffix("\n"))
            data, size, event = io.StringIO(), 0, "message"
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "data":
            size += len(line) + 1
            if size > limit:
                raise TooLong(f"an event of more than {limit} bytes")
            data.write(value)
            data.write("\n")
        elif name == "event":
            event = value
        elif name == "id" and "\0" not in value:
            last_id = value
