"""What an activity hands back to the workflow stays small.

Activity results are recorded in workflow history (2 MiB per payload at
most), and what a seat hears is carried into every later turn and through
continue-as-new. A tool result or model text over its limit is kept in the
database (encrypted, by reference) and the workflow gets a preview that says
it is one.
"""

from __future__ import annotations

import json
from typing import Any

from roundtable.store import Store

MAX_INLINE_RESULT_BYTES = 16 * 1024
MAX_INLINE_TEXT_BYTES = 32 * 1024
PREVIEW_CHARS = 2_000


def _size(value: Any) -> int:
    return len(json.dumps(value, default=str, ensure_ascii=False).encode())


async def bounded_result(
    store: Store, *, run_id: str, seat: str, call_id: str, content: dict[str, Any]
) -> dict[str, Any]:
    """``content`` itself when small; else a reference and a preview."""
    size = _size(content)
    if size <= MAX_INLINE_RESULT_BYTES:
        return content
    ref = await store.save_tool_result(run_id=run_id, seat=seat, call_id=call_id, content=content)
    return {
        "truncated": True,
        "result_ref": ref,
        "size_bytes": size,
        "preview": json.dumps(content, default=str, ensure_ascii=False)[:PREVIEW_CHARS],
        "note": (
            f"the full result ({size} bytes) is too large to pass along; "
            f"this is its first {PREVIEW_CHARS} characters"
        ),
    }


async def bounded_text(store: Store, *, run_id: str, seat: str, call_id: str, text: str) -> str:
    """``text`` itself when small; else its beginning and a note with the reference."""
    size = len(text.encode())
    if size <= MAX_INLINE_TEXT_BYTES:
        return text
    ref = await store.save_tool_result(run_id=run_id, seat=seat, call_id=call_id, content=text)
    keep = text[: MAX_INLINE_TEXT_BYTES // 4]
    return f"{keep}\n[truncated: the full text ({size} bytes) is kept as {ref}]"
