"""Run a Python snippet from standard input the way `python -m asyncio` would
(top-level ``await`` allowed), as our documentation's snippets are written."""

from __future__ import annotations

import ast
import asyncio
import sys


async def _run(source: str) -> None:
    code = compile(source, "<snippet>", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    result = eval(code, {"__name__": "__main__"})  # noqa: S307 (our own documentation)
    if asyncio.iscoroutine(result):
        await result


if __name__ == "__main__":
    asyncio.run(_run(sys.stdin.read()))
