"""A real MCP server for the tests, built with the official SDK.

It keeps a JSON-lines log of every call it receives (with the `_meta` it got):
the ground truth of what the outside world saw. `update_record` and `lookup`
on record "crash" kill the process mid-call.

    python records_server.py                 # stdio
    python records_server.py http <port>     # streamable HTTP on 127.0.0.1
"""

from __future__ import annotations

import json
import os
import sys

from mcp.server.mcpserver import Context, MCPServer
from mcp_types import ToolAnnotations

LOG = os.environ.get("RECORDS_LOG", "records.log")
server = MCPServer("records")


def _log(entry: dict) -> None:
    with open(LOG, "a") as handle:
        handle.write(json.dumps(entry) + "\n")


@server.tool(annotations=ToolAnnotations(read_only_hint=True))
def lookup(record_id: str) -> dict:
    """Read a record."""
    _log({"tool": "lookup", "record_id": record_id})
    if record_id == "crash":
        os._exit(1)  # "read-only", yet it dies mid-call
    return {"record_id": record_id, "status": "open"}


@server.tool(annotations=ToolAnnotations(destructive_hint=False))
def update_record(record_id: str, status: str, ctx: Context) -> dict:
    """Set a record's status."""
    meta = ctx.request_context.meta
    seen = meta.model_dump() if hasattr(meta, "model_dump") else dict(meta or {})
    _log({"tool": "update_record", "record_id": record_id, "status": status, "meta": seen})
    if record_id == "crash":
        os._exit(1)  # dies mid-call: the caller cannot know what happened
    return {"record_id": record_id, "status": status}


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "http":
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        server.run()
