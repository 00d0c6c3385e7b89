"""Run a Python snippet from standard input the way `python -m asyncio` would
(top-level ``await`` allowed), as our documentation's snippets are written."""

from __future__ import annotations

import ast
import asyncio
import os
import sys
import traceback


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
        # As the CLI does (roundtable/cli/__init__.py): leave without
        # interpreter finalization, which a process that used the Temporal
        # client aborts about once in forty ("PyGILState_Release ...
        # finalizing", temporalio/sdk-python#300) after the snippet ran
        # well. The snippet's own failures still fail it.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
