"""A model's tool calls made safe to act on, whatever the model wrote.

Models repeat call ids within a turn, emit dozens of calls, or stuff huge
arguments into one. Each call gets its own identity (the idempotency key of a
write is built from it, so two writes must never share one), and what is too
many or too large comes back to the seat as a malformed call: nothing runs.
"""

from __future__ import annotations

import json

from roundtable.models import ToolCall

MAX_TOOL_CALLS_PER_TURN = 16
MAX_ARGUMENT_BYTES = 64 * 1024
MAX_CALL_ID_CHARS = 128


def sanitize_tool_calls(calls: list[ToolCall]) -> list[ToolCall]:
    seen: set[str] = set()
    checked = []
    for index, call in enumerate(calls, start=1):
        call_id = _unique(call.id[:MAX_CALL_ID_CHARS] or f"call-{index}", seen)
        problem = call.malformed
        if problem is None and index > MAX_TOOL_CALLS_PER_TURN:
            problem = f"too many tool calls in one turn (at most {MAX_TOOL_CALLS_PER_TURN})"
        if problem is None and _size(call.arguments) > MAX_ARGUMENT_BYTES:
            problem = f"arguments larger than {MAX_ARGUMENT_BYTES} bytes"
        checked.append(
            call.model_copy(
                update={
                    "id": call_id,
                    "malformed": problem,
                    "arguments": {} if problem else call.arguments,
                }
            )
        )
    return checked


def _unique(call_id: str, seen: set[str]) -> str:
    candidate, n = call_id, 1
    while candidate in seen:
        n += 1
        candidate = f"{call_id}#{n}"
    seen.add(candidate)
    return candidate


def _size(arguments: object) -> int:
    return len(json.dumps(arguments, default=str, ensure_ascii=False).encode())
