"""The journal of model turns (ToolResults.keep_turn): a turn's first answer
is its only answer, kept encrypted; on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio

from sqlalchemy import select

from roundtable.store.schema import ToolResultRow
from tests.helpers import new_run

SECRET_ARG = "sk-live-CANARY-turn-5d1e"


def answer(n: int) -> dict:
    return {
        "text": f"answer {n}",
        "tool_calls": [{"id": f"call-{n}", "name": "ticket_update", "args": {"k": SECRET_ARG}}],
        "usage": None,
    }


async def test_the_first_answer_kept_is_the_only_one(store) -> None:
    run = await new_run(store)
    turn = {"run_id": run["id"], "role": "seat", "seat": "seat-1", "round_number": 1, "chain": "c1"}
    assert await store.kept_turn(**turn) is None
    kept = await asyncio.gather(*(store.keep_turn(**turn, response=answer(n)) for n in range(4)))
    assert len({k["text"] for k, _ in kept}) == 1  # every attempt gets the winner's
    assert [ours for _, ours in kept].count(True) == 1  # and knows whether it won
    again, ours = await store.keep_turn(**turn, response=answer(9))
    assert not ours and again == kept[0][0] == await store.kept_turn(**turn)
    # Another round, role or seat is another turn; so is another chain of
    # executions (a new start under the run's id; a reset or continue-as-new
    # keeps its chain, tests/test_recovery.py).
    for other in ({"round_number": 2}, {"role": "manager"}, {"seat": "seat-2"}, {"chain": "c2"}):
        assert await store.kept_turn(**{**turn, **other}) is None


async def test_a_kept_turn_is_encrypted_at_rest(store) -> None:
    run = await new_run(store)
    turn = {"run_id": run["id"], "role": "seat", "seat": "seat-1", "round_number": 1}
    await store.keep_turn(**turn, response=answer(1))
    async with store.db.reader() as session:
        rows = (await session.execute(select(ToolResultRow))).scalars().all()
    (row,) = rows
    assert SECRET_ARG not in row.content_encrypted and "answer 1" not in row.content_encrypted
    assert (await store.kept_turn(**turn))["tool_calls"][0]["args"]["k"] == SECRET_ARG
