"""Model turns: the journal of each turn's first answer, kept encrypted, and
each turn's token usage in the run's log.

A turn run again (a reset that dropped its completion, a retry after its
result was lost) gets the answer the run may already have acted on, not a
new one whose tool calls the store would take for new writes
(roundtable/recovery.py). The answer is kept under an id derived from the
run, role, seat, round and chain of executions, in the tool results' table
(its rows are sealed alike).

Keeping an answer is one statement sent with its commit, and the read
before the model call is made only where an answer can be kept already
(run_activities.take_turn): the journal as first written (a read, then an
insert, each an ORM session) cost 12 to 17 ms of a throughput run's worker
CPU, about a sixth (bench/README, "What was cut"). Each turn's token usage
goes to the run's audit log, once (:meth:`Turns.record_usage`).
"""

from __future__ import annotations

import hashlib
import json
from datetime import UTC, datetime
from functools import cache
from typing import Any

from sqlalchemy import bindparam, func, select

from roundtable.completion import complete_every_public_coroutine
from roundtable.security import decrypt_arguments, encrypt_arguments
from roundtable.store.core_writes import (
    ChainedRun,
    event_logged,
    execute_last,
    facts_read,
    locked_facts,
)
from roundtable.store.database import Database
from roundtable.store.engine import dialect_insert, is_postgresql
from roundtable.store.errors import InvalidInputError, NotFoundError
from roundtable.store.rows import require_text
from roundtable.store.schema import AuditEventRow, RunRow, ToolResultRow
from roundtable.store.text import escape_text

_RESULTS = ToolResultRow.__table__
_EVENTS = AuditEventRow.__table__
_RUNS = RunRow.__table__
TURN_COMPLETED = "turn.completed"
# A chain is a Temporal run id (a UUID): this is room to spare, not a guess.
MAX_CHAIN_CHARS = 128


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
    """The keep, one statement: PostgreSQL reads its clock in it (no trip of
    its own); SQLite's clock is this process's, bound as ``created_at``."""
    statement = dialect_insert(postgresql, _RESULTS)
    if postgresql:
        statement = statement.values(created_at=func.clock_timestamp())
    return statement.on_conflict_do_nothing(index_elements=["id"]).returning(_RESULTS.c.id)


@cache
def _chain_head(postgresql: bool) -> Any:
    """The run's chain head and the clock, read under its lock: not the
    whole row, which a turn's usage has no use for."""
    return facts_read(postgresql, _RUNS, _RUNS, [_RUNS.c.id])


@cache
def _kept_body() -> Any:
    return select(_RESULTS.c.content_encrypted).where(_RESULTS.c.id == bindparam("turn_id"))


@complete_every_public_coroutine
class Turns:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def keep(
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
        commit wins). One statement, sent with its commit (one trip on
        SQLite): the insert that refuses a second answer says whose stands."""
        require_text("run_id", run_id)
        turn_id = turn_result_id(run_id, role, seat, round_number, chain)
        body = {"content": response}
        sealed = encrypt_arguments(body, associated_data=turn_id.encode())
        async with self.db.core_transaction() as (connection, _):
            postgresql = is_postgresql(connection)
            written = await execute_last(
                connection,
                _keep_once(postgresql),
                {
                    "id": turn_id,
                    "run_id": run_id,
                    "seat": escape_text(seat)[:255],
                    "call_id": escape_text(f"turn:{role}:r{round_number}")[:255],
                    "size_bytes": len(json.dumps(body, default=str)),
                    "content_encrypted": sealed,
                    **({} if postgresql else {"created_at": datetime.now(UTC)}),
                },
            )
            ours = written.scalar_one_or_none() is not None
        if ours:
            return response, True
        # Another attempt kept its answer first: that one stands.
        kept = await self.kept(
            run_id=run_id, role=role, seat=seat, round_number=round_number, chain=chain
        )
        if kept is None:
            raise NotFoundError(f"turn {turn_id} was kept but cannot be read back")
        return kept, False

    async def kept(
        self, *, run_id: str, role: str, seat: str, round_number: int, chain: str | None = None
    ) -> dict[str, Any] | None:
        """The response kept for this turn, or None if it has not been taken."""
        turn_id = turn_result_id(run_id, role, seat, round_number, chain)
        async with self.db.core_reader(alone=True) as connection:
            sealed = (
                await connection.execute(_kept_body(), {"turn_id": turn_id})
            ).scalar_one_or_none()
        if sealed is None:
            return None
        return decrypt_arguments(sealed, associated_data=turn_id.encode())["content"]

    async def record_usage(
        self,
        run_id: str,
        *,
        seat: str,
        round_number: int,
        model: str,
        prompt_tokens: int,
        completion_tokens: int,
        role: str = "seat",
        chain: str | None = None,
    ) -> bool:
        """A model turn's token usage, in the run's audit log (summed by
        views). Once per turn of a chain of executions (``chain``, as
        :meth:`keep` takes it): a turn taken again finds its event and adds
        none (False), so the log's usage matches the workflow's; another
        chain under the run's id asked the model afresh (its journal is its
        own), and its turns' usage is logged apart."""
        # One event per turn of a chain: keyed by the journal's id for it,
        # whose length is bounded whatever the chain's; runs from before
        # chains name none, and keep the key they were logged under.
        if chain is None:
            key = escape_text(f"{TURN_COMPLETED}:{role}:{seat}:{round_number}")
        else:
            if len(require_text("chain", chain)) > MAX_CHAIN_CHARS:
                raise InvalidInputError(
                    f"chain must be at most {MAX_CHAIN_CHARS} characters", field="chain"
                )
            turn = turn_result_id(run_id, role, seat, round_number, chain)
            key = f"{TURN_COMPLETED}:{turn}"
        async with self.db.core_transaction() as (connection, _):
            held, now = await locked_facts(connection, _RUNS, run_id, _chain_head, "run")
            seen = await connection.execute(event_logged(), {"run_id": run_id, "key": key})
            if seen.scalar_one_or_none() is not None:
                return False
            run = ChainedRun(held["id"], held["last_event_seq"], held["last_event_hash"])
            payload = {
                "seat": seat,
                "round": round_number,
                "model": model,
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
            }
            if chain is not None:
                payload["chain"] = chain
            run.append(TURN_COMPLETED, payload, now, dedupe_key=key)
            await run.write(connection, now)
        return True
