"""Tool results and model text too large for workflow history.

Temporal refuses payloads over 2 MiB, and everything a seat hears is carried
into every later turn. What is too large stays here, encrypted (bound to its
id, like tool arguments), and the workflow carries a reference and a preview.

The journal of model turns keeps its answers in the same table
(roundtable/store/turns.py).
"""

from __future__ import annotations

import json
from typing import Any

from roundtable.completion import complete_every_public_coroutine
from roundtable.security import decrypt_arguments, encrypt_arguments
from roundtable.store.database import Database
from roundtable.store.engine import database_now
from roundtable.store.errors import NotFoundError
from roundtable.store.rows import new_id, require_text
from roundtable.store.schema import ToolResultRow
from roundtable.store.text import escape_text


@complete_every_public_coroutine
class ToolResults:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def save(self, *, run_id: str, seat: str, call_id: str, content: Any) -> str:
        """Keep ``content`` (anything JSON can hold); returns its reference."""
        require_text("run_id", run_id)
        result_id = f"result-{new_id()}"
        body = {"content": content}
        sealed = encrypt_arguments(body, associated_data=result_id.encode())
        size = len(json.dumps(body, default=str))
        async with self.db.transaction() as session:
            session.add(
                ToolResultRow(
                    id=result_id,
                    run_id=run_id,
                    seat=escape_text(seat)[:255],
                    call_id=escape_text(call_id)[:255],
                    size_bytes=size,
                    content_encrypted=sealed,
                    created_at=await database_now(session),
                )
            )
        return result_id

    async def get(self, result_id: str) -> dict[str, Any]:
        """``{"id", "run_id", "seat", "call_id", "size_bytes", "content"}``."""
        async with self.db.reader() as session:
            row = await session.get(ToolResultRow, result_id)
            if row is None:
                raise NotFoundError(f"tool result {result_id!r} not found")
            sealed = row.content_encrypted
            meta = {
                "id": row.id,
                "run_id": row.run_id,
                "seat": row.seat,
                "call_id": row.call_id,
                "size_bytes": row.size_bytes,
            }
        return {
            **meta,
            "content": decrypt_arguments(sealed, associated_data=result_id.encode())["content"],
        }
