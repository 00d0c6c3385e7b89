"""Run a Python snippet from standard input the way `python -m asyncio` would
(top-level ``await`` allowed), as our documentation's snippets are written."""

from __future__ import annotations

import ast
import asyncio
import sys
import traceback

from roundtable.process_exit import leave


async def _run(source: str) -> None:
    code = compile(source, "<snippet>", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    result = eval(code, {"__name__": "__main__"})  # noqa: S307 (our own documentation)
    if asyncio.iscoroutine(result):
        await result


if __name__ == "__main__":
    status = 0
    try:
        asyncio.run(_run(sys.stdin.read()))
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
        status = 1
    finally:
        # As the CLI does: a snippet that ran well must not fail at exit
        # (roundtable.process_exit). Its own failures still fail it.
        leave(status)
