"""A small local MCP server (stdio) to try Roundtable's MCP tools with: a
notebook kept in a JSON file. `list_notes` only reads; `add_note` writes, and
is keyed by the note's topic, so two writes to one topic never overlap.

Roundtable starts it from examples/mcp/mcp.json; by hand:

    .venv/bin/python examples/mcp/notes_server.py
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from mcp.server.mcpserver import MCPServer
from mcp_types import ToolAnnotations

NOTES = Path(os.environ.get("NOTES_FILE", ".roundtable/notes.json"))
server = MCPServer("notes")


def _read() -> dict[str, list[str]]:
    return json.loads(NOTES.read_text()) if NOTES.exists() else {}


@server.tool(annotations=ToolAnnotations(read_only_hint=True))
def list_notes(topic: str) -> dict:
    """The notes kept under a topic."""
    return {"topic": topic, "notes": _read().get(topic, [])}


@server.tool(annotations=ToolAnnotations(destructive_hint=False))
def add_note(topic: str, text: str) -> dict:
    """Add a note under a topic."""
    notes = _read()
    notes.setdefault(topic, []).append(text)
    NOTES.parent.mkdir(parents=True, exist_ok=True)
    NOTES.write_text(json.dumps(notes, indent=2))
    return {"topic": topic, "count": len(notes[topic])}


if __name__ == "__main__":
    server.run()
