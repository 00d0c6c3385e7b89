"""Database calls that a cancellation never cuts off half-way.

Cancelled mid-transaction, an aiosqlite connection was seen to keep SQLite's
write lock for the full busy timeout (a minute), stalling every writer of the
database file. Wrapped calls run to their own end; the caller's cancellation
is raised once they have.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Awaitable, Callable
from typing import Any, ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


async def waited_out(call: asyncio.Future[Any]) -> bool:
    """Wait for ``call`` to end, whatever cancels the caller meanwhile;
    whether the caller was cancelled (its cancellation is the caller's to
    raise, once it has done what the call's end asks)."""
    cancelled = False
    while not call.done():
        try:
            await asyncio.wait({call})
        except asyncio.CancelledError:
            cancelled = True
    return cancelled


def to_completion(method: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
    @functools.wraps(method)
    async def run_to_completion(*args: P.args, **kwargs: P.kwargs) -> R:
        call: asyncio.Future[R] = asyncio.ensure_future(method(*args, **kwargs))
        if await waited_out(call):
            raise asyncio.CancelledError()
        return call.result()

    return run_to_completion


def complete_every_public_coroutine(cls: type[Any]) -> type[Any]:
    """Wrap each public coroutine method of ``cls`` (as its MRO resolves it)."""
    for name in dir(cls):
        member = getattr(cls, name)
        if not name.startswith("_") and inspect.iscoroutinefunction(member):
            setattr(cls, name, to_completion(member))
    return cls
