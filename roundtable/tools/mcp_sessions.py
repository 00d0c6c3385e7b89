"""One long-lived MCP session per stdio server, shared by all of a worker's calls.

Starting a stdio server costs 0.5 to 1 s, so the worker keeps one session per
configured server open from tool discovery (at worker start) until it shuts
down, and starts a new one only when the old one has ended.

**Nothing is sent twice.** A call is handed to exactly one session. Before it
is handed over, a session known to have ended (its server exited, its pipe
closed, the worker is stopping) is replaced by a fresh one: the call was never
sent, so running it on the new session is running it once. Once handed over,
whatever happens is that session's: a server that dies mid-call makes the call
raise the SDK's ``MCPError`` "Connection closed", which callers treat as they
always did (a write ends ``unknown``; an untrusted read is not run again). A
session counts as ended from the moment its transport's read stream ends: the
SDK's dispatcher closes in that same step, so it never refuses a request
unsent while this module still takes the session for alive. A server that
died but whose pipe's end the worker has not read yet looks alive; a call sent
then fails like a mid-call death and is treated as one: a wrong guess costs an
``unknown``, never a second write.

**A server that cannot be started** (spawn or handshake fails) raises
``MCPUnavailable``, a definite failure: no request was sent. Sessions restart
lazily, on the next call, so a server that keeps dying costs one start per
call and never a restart loop.

**Each session lives in a task of its own.** The SDK's ``stdio_client`` and
``ClientSession`` are anyio context managers that must be entered and exited by
one task, and the task that first needs a server (an activity) ends, or is
cancelled, long before the session should. Other tasks only send requests
through the session's ``Client``; the SDK correlates concurrent requests by id
(each waiter has its own stream), so calls share a session without a lock, and
a server that handles requests one at a time simply answers them in turn.

**HTTP servers keep one client per call.** A kept streamable-HTTP session
cannot tell a server that restarted between calls from one that failed
mid-call (both are an error on the request itself), and per call it costs a
handshake, not a process start.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from types import TracebackType
from typing import Any

import anyio
from mcp import Client, StdioServerParameters, stdio_client
from mcp.client import Transport
from mcp_types import CallToolResult, Tool

from roundtable.tools.registry import ToolDefiniteFailure

log = logging.getLogger("roundtable.mcp")
# A fresh session that ends before it could be used is tried this many times
# in one call: a server that dies as it starts is unavailable, not retried for ever.
_FRESH_SESSIONS_PER_CALL = 2


class MCPUnavailable(ToolDefiniteFailure):
    """No session to the server could be had: the request was never sent."""

    def __init__(self, server: str, reason: str) -> None:
        super().__init__("mcp_unavailable", f"MCP server {server!r} unavailable: {reason}")


def _describe(exc: BaseException) -> str:
    """What went wrong, short: the SDK wraps its failures in task-group
    exception groups, whose own message names none of them."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}"[:300]


class _WatchedReadStream:
    """The transport's read stream, reporting its end to ``on_end``: the
    moment the SDK's dispatcher sees the connection close, so do we."""

    def __init__(self, inner: Any, on_end: Callable[[], None]) -> None:
        self._inner = inner
        self._on_end = on_end

    async def receive(self) -> Any:
        try:
            return await self._inner.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError):
            self._on_end()
            raise

    def __aiter__(self) -> _WatchedReadStream:
        return self

    async def __anext__(self) -> Any:
        try:
            return await self.receive()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None

    async def aclose(self) -> None:
        self._on_end()
        await self._inner.aclose()

    async def __aenter__(self) -> _WatchedReadStream:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc_val: BaseException | None,
        exc_tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def __getattr__(self, name: str) -> Any:  # e.g. ``last_context``
        return getattr(self._inner, name)


@asynccontextmanager
async def _watched(
    transport: Transport, on_end: Callable[[], None]
) -> AsyncIterator[tuple[Any, Any]]:
    async with transport as (read_stream, write_stream):
        yield _WatchedReadStream(read_stream, on_end), write_stream


class _Session:
    """One server session, owned (entered and exited) by its own task."""

    def __init__(self, name: str, params: StdioServerParameters) -> None:
        self.name = name
        self._params = params
        self._client: Client | None = None
        self._failure: str | None = None
        self._settled = asyncio.Event()  # opened, or failed to
        self._ending = asyncio.Event()  # the connection ended, or stop() was called
        self._stopping = False
        # A fresh context: the session outlives the task that opened it and
        # must carry none of its context (an activity's, a request's trace).
        self.task = asyncio.create_task(
            self._own(), name=f"mcp-session-{name}", context=contextvars.Context()
        )

    @property
    def opened(self) -> bool:
        return self._client is not None

    @property
    def ended(self) -> bool:
        """True once nothing more can be sent on this session."""
        return self._ending.is_set() or self.task.done()

    async def client(self) -> Client:
        """The open session's client, or MCPUnavailable. Cancelling the
        caller leaves the opening to go on for whoever asks next."""
        await self._settled.wait()
        if self._client is None:
            raise MCPUnavailable(self.name, self._failure or "the session did not open")
        return self._client

    def stop(self) -> None:
        self._stopping = True
        self._ending.set()

    async def _own(self) -> None:
        try:
            transport = _watched(stdio_client(self._params), self._ending.set)
            # cache=None: every call must reach the server, none be served from memory.
            async with Client(transport, cache=None) as client:
                self._client = client
                self._settled.set()
                await self._ending.wait()
                if not self._stopping:
                    log.warning("MCP server %s exited or closed its pipe", self.name)
        except Exception as exc:  # the server could not start, or failed as it closed
            if not self._settled.is_set():
                self._failure = _describe(exc)
                log.warning("MCP server %s did not start: %s", self.name, self._failure)
            else:
                log.warning("MCP server %s session closed with %s", self.name, _describe(exc))
        finally:
            self._ending.set()
            self._settled.set()


class MCPSessions:
    """The worker's MCP sessions: one per stdio server, opened on first use
    (tool discovery), replaced when it ended, closed with ``aclose``."""

    def __init__(self) -> None:
        self._current: dict[str, _Session] = {}
        self._all: set[_Session] = set()  # the current ones and those still winding down
        self._closed = False

    async def __aenter__(self) -> MCPSessions:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def is_open(self, server: str) -> bool:
        """Whether the server has a session open that has not ended."""
        session = self._current.get(server)
        return session is not None and session.opened and not session.ended

    async def list_tools(self, server: str, target: StdioServerParameters | str) -> list[Tool]:
        async with self._client(server, target) as client:
            return list((await client.list_tools()).tools)

    async def call_tool(
        self,
        server: str,
        target: StdioServerParameters | str,
        tool: str,
        arguments: dict[str, Any],
        *,
        meta: dict[str, Any] | None,
    ) -> CallToolResult:
        """One ``tools/call``, sent at most once (see the module's docstring)."""
        async with self._client(server, target) as client:
            return await client.call_tool(tool, arguments, meta=meta)

    async def aclose(self) -> None:
        """Close every session and wait until their servers are gone."""
        self._closed = True
        sessions = list(self._all)
        for session in sessions:
            session.stop()
        # The SDK bounds each shutdown (stdin closed, then SIGTERM, then SIGKILL).
        await asyncio.gather(*(s.task for s in sessions), return_exceptions=True)

    @asynccontextmanager
    async def _client(
        self, server: str, target: StdioServerParameters | str
    ) -> AsyncIterator[Client]:
        if isinstance(target, str):
            async with AsyncExitStack() as stack:
                try:
                    client = await stack.enter_async_context(Client(target))
                except Exception as exc:
                    raise MCPUnavailable(server, _describe(exc)) from exc
                yield client
            return
        # Nothing yields between _live's last look at the session and the
        # SDK's own (its dispatcher refuses a request on a closed connection
        # before writing it). Were the session to end in between, that refusal
        # would look like a mid-call death and count as one: an unknown, never
        # a resend.
        yield await self._live(server, target)

    async def _live(self, server: str, params: StdioServerParameters) -> Client:
        for _ in range(_FRESH_SESSIONS_PER_CALL):
            if self._closed:
                raise MCPUnavailable(server, "the worker is shutting down")
            session = self._current.get(server)
            if session is None or session.ended:
                session = self._start(server, params)
            client = await session.client()
            if not session.ended:
                return client
        raise MCPUnavailable(server, "its session ended as soon as it opened")

    def _start(self, server: str, params: StdioServerParameters) -> _Session:
        session = _Session(server, params)
        self._current[server] = session
        self._all.add(session)
        session.task.add_done_callback(lambda _: self._all.discard(session))
        log.info("MCP server %s: session starting", server)
        return session
