"""Keep what a run carries within Temporal's limits.

Every seat's thread and the shared transcript travel in each turn's activity
input, in the ``state`` query and through continue-as-new; Temporal refuses any
payload over 2 MiB, and a workflow whose every task fails on that is wedged for
good. Each entry is already bounded when it is made (activities keep large
results by reference); this module bounds their sum, eliding the oldest
contents first and saying so in their place. Pure and deterministic: the
workflow calls it.
"""

from __future__ import annotations

import json

from roundtable.models import ChatMessage

# What threads and transcript may hold together, in UTF-8 bytes of content.
# With the run's request (a bounded script, task and tools) a turn's input
# stays well under Temporal's 2 MiB payload limit.
CONTEXT_BUDGET_BYTES = 768 * 1024
ELIDED_PREFIX = "[elided to keep the run within its size limit:"
MIN_ELIDED_BYTES = 256


def _size(message: ChatMessage) -> int:
    calls = sum(len(json.dumps(c.arguments, default=str).encode()) for c in message.tool_calls)
    return len(message.content.encode()) + calls


def _elided(message: ChatMessage) -> ChatMessage:
    # A tool call keeps its id and name (the reply to it refers to them);
    # only its arguments go.
    calls = [
        c.model_copy(update={"arguments": {"elided": True}}) if c.arguments else c
        for c in message.tool_calls
    ]
    return message.model_copy(
        update={
            "content": f"{ELIDED_PREFIX} {_size(message)} bytes of earlier text]",
            "tool_calls": calls,
        }
    )


def fit_context(
    threads: dict[str, list[ChatMessage]],
    transcript: list[ChatMessage],
    budget: int = CONTEXT_BUDGET_BYTES,
) -> int:
    """Elide, in place, the oldest message contents (system prompts last) until
    threads and transcript fit ``budget``. Returns how many were elided."""
    entries = [(index, lst) for lst in (transcript, *threads.values()) for index in range(len(lst))]
    total = sum(_size(lst[index]) for index, lst in entries)
    if total <= budget:
        return 0
    # Oldest first across all lists: position in its list is the proxy for age
    # (each list only grows at its end); system prompts go last of all.
    entries.sort(key=lambda e: (e[1][e[0]].role == "system", e[0]))
    elided = 0
    for index, lst in entries:
        if total <= budget:
            break
        message = lst[index]
        if message.content.startswith(ELIDED_PREFIX) or _size(message) < MIN_ELIDED_BYTES:
            continue  # already elided, or too small for eliding to help
        replacement = _elided(message)
        total -= _size(message) - _size(replacement)
        lst[index] = replacement
        elided += 1
    return elided
