"""A real stdio MCP server whose life the session tests watch.

At start it appends its PID to the file named by ``LIFECYCLE_STARTS``: one
line per process started, so a test counts server starts. Every call appends
a JSON line (with the server's PID and the `_meta` it got) to the file named by
``LIFECYCLE_LOG``: the ground truth of what the outside world saw.

- ``set_value`` (a write) on key "block" logs the call, then blocks until the
  process is killed: a test kills it by PID while the caller waits.
- ``get_value`` is read-only.
- ``meet(n)`` (read-only) answers only once ``n`` calls are inside it at once:
  calls that all return were served side by side.

With ``LIFECYCLE_LINGER`` set, it does not end when its input closes (a
thread of its own runs on). With ``LIFECYCLE_ENV`` set, it writes the names
of the environment variables it was started with to that file.

    python lifecycle_server.py
"""

from __future__ import annotations

import json
import os
import threading

import anyio
from mcp.server.mcpserver import Context, MCPServer
from mcp_types import ToolAnnotations

LOG = os.environ.get("LIFECYCLE_LOG", "lifecycle.log")
STARTS = os.environ.get("LIFECYCLE_STARTS", "lifecycle.starts")
server = MCPServer("lifecycle")
_inside = 0
_all_met: anyio.Event | None = None


def _log(entry: dict) -> None:
    with open(LOG, "a") as handle:
        handle.write(json.dumps({**entry, "pid": os.getpid()}) + "\n")


@server.tool(annotations=ToolAnnotations(destructive_hint=False))
async def set_value(key: str, value: str, ctx: Context) -> dict:
    """Set a key's value."""
    meta = ctx.request_context.meta
    seen = meta.model_dump() if hasattr(meta, "model_dump") else dict(meta or {})
    _log({"tool": "set_value", "key": key, "value": value, "meta": seen})
    if key == "block":
        await anyio.sleep_forever()  # until a test kills this process
    return {"key": key, "value": value, "pid": os.getpid()}


@server.tool(annotations=ToolAnnotations(read_only_hint=True))
def get_value(key: str) -> dict:
    """Read a key."""
    _log({"tool": "get_value", "key": key})
    return {"key": key, "pid": os.getpid()}


@server.tool(annotations=ToolAnnotations(read_only_hint=True))
async def meet(n: int) -> dict:
    """Return once n calls are in here together."""
    global _inside, _all_met
    if _all_met is None:
        _all_met = anyio.Event()
    _inside += 1
    _log({"tool": "meet", "inside": _inside})
    if _inside >= n:
        _all_met.set()
    await _all_met.wait()
    return {"met": n, "pid": os.getpid()}


if __name__ == "__main__":
    with open(STARTS, "a") as starts:
        starts.write(f"{os.getpid()}\n")
    if os.environ.get("LIFECYCLE_LINGER"):
        # Background work that outlives its input closing, as many real
        # servers have: only a signal ends this process.
        threading.Thread(target=threading.Event().wait, daemon=False).start()
    if os.environ.get("LIFECYCLE_ENV"):  # which variables it was given, for the leak test
        with open(os.environ["LIFECYCLE_ENV"], "w") as seen:
            json.dump(sorted(os.environ), seen)
    server.run()
