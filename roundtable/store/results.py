"""Tool results and model text too large for workflow history, and the
journal of model turns.

Temporal refuses payloads over 2 MiB, and everything a seat hears is carried
into every later turn. What is too large stays here, encrypted (bound to its
id, like tool arguments), and the workflow carries a reference and a preview.

Each model turn's response is kept here too, under an id derived from the
run, role, seat and round: a turn run again (a reset that dropped its
completion, a retry after its result was lost) gets the answer the run may
already have acted on, not a new one whose tool calls the store would take
for new writes (roundtable/recovery.py).
"""

from __future__ import annotations

import hashlib
import json
from functools import cache
from typing import Any

from sqlalchemy import select

from roundtable.completion import complete_every_public_coroutine
from roundtable.security import decrypt_arguments, encrypt_arguments
from roundtable.store.database import Database
from roundtable.store.engine import database_now, dialect_insert, is_postgresql
from roundtable.store.errors import NotFoundError
from roundtable.store.rows import new_id, require_text
from roundtable.store.schema import ToolResultRow
from roundtable.store.text import escape_text

_RESULTS = ToolResultRow.__table__


def turn_result_id(
    run_id: str, role: str, seat: str, round_number: int, chain: str | None = None
) -> str:
    """The journal's id for one turn of one chain of executions (the id
    column holds 64 characters); runs from before chains name none."""
    key: list[Any] = [run_id, role, seat, round_number]
    if chain is not None:
        key.append(chain)
    digest = hashlib.sha256(json.dumps(key).encode())
    return f"turn-{digest.hexdigest()[:59]}"


@cache
def _keep_once(postgresql: bool) -> Any:
    return (
        dialect_insert(postgresql, _RESULTS)
        .on_conflict_do_nothing(index_elements=["id"])
        .returning(_RESULTS.c.id)
    )


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

    async def keep_turn(
        self,
        *,
        run_id: str,
        role: str,
        seat: str,
        round_number: int,
        response: dict[str, Any],
        chain: str | None = None,
    ) -> tuple[dict[str, Any], bool]:
        """Keep the turn's ``response`` unless one is kept already: ``(the kept
        one, whether it is this one)`` (of two attempts at once, the first to
        commit wins)."""
        require_text("run_id", run_id)
        result_id = turn_result_id(run_id, role, seat, round_number, chain)
        body = {"content": response}
        sealed = encrypt_arguments(body, associated_data=result_id.encode())
        async with self.db.transaction() as session:
            written = await session.execute(
                _keep_once(is_postgresql(session)),
                {
                    "id": result_id,
                    "run_id": run_id,
                    "seat": escape_text(seat)[:255],
                    "call_id": escape_text(f"turn:{role}:r{round_number}")[:255],
                    "size_bytes": len(json.dumps(body, default=str)),
                    "content_encrypted": sealed,
                    "created_at": await database_now(session),
                },
            )
            if written.scalar_one_or_none() is not None:
                return response, True
        # Another attempt kept its answer first: that one stands.
        kept = await self.kept_turn(
            run_id=run_id, role=role, seat=seat, round_number=round_number, chain=chain
        )
        if kept is None:
            raise NotFoundError(f"turn {result_id} was kept but cannot be read back")
        return kept, False

    async def kept_turn(
        self, *, run_id: str, role: str, seat: str, round_number: int, chain: str | None = None
    ) -> dict[str, Any] | None:
        """The response kept for this turn, or None if it has not been taken."""
        result_id = turn_result_id(run_id, role, seat, round_number, chain)
        async with self.db.reader() as session:
            sealed = (
                await session.execute(
                    select(_RESULTS.c.content_encrypted).where(_RESULTS.c.id == result_id)
                )
            ).scalar_one_or_none()
        if sealed is None:
            return None
        return decrypt_arguments(sealed, associated_data=result_id.encode())["content"]
