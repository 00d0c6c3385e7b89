"""Model turns (roundtable/store/turns.py): a turn's first answer is its only
answer, kept encrypted, and its usage is logged once; on SQLite and
PostgreSQL."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses

import pytest
from sqlalchemy import exc, select
from temporalio.testing import ActivityEnvironment

from activities.run_activities import RunActivities
from roundtable.agents.scripted import ScriptedModel
from roundtable.models import TakeTurnInput, TokenUsage
from roundtable.store import InvalidInputError, NotFoundError
from roundtable.store.schema import ToolResultRow
from roundtable.tools.registry import ToolRegistry
from tests.helpers import new_run
from tests.workflow_harness import TRUSTING

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


async def usage_events(store, run_id: str) -> list[dict]:
    return [e for e in await store.list_events(run_id) if e["event_type"] == "turn.completed"]


async def test_a_turns_usage_is_logged_once_and_the_chain_holds(store) -> None:
    """Whichever attempts record a turn's usage, at once or one after another
    (a turn taken again gets the kept answer and records its usage again),
    the log holds it once."""
    run = await new_run(store)
    usage = {"model": "m", "prompt_tokens": 100, "completion_tokens": 20}
    turn = {"seat": "seat-1", "round_number": 1, **usage}
    recorded = await asyncio.gather(*(store.record_turn(run["id"], **turn) for _ in range(4)))
    assert sorted(recorded) == [False, False, False, True]
    assert not await store.record_turn(run["id"], **turn)
    assert await store.record_turn(run["id"], **{**turn, "role": "manager"})
    (seat, manager) = await usage_events(store, run["id"])
    assert seat["payload"] == {"seat": "seat-1", "round": 1, **usage}
    assert manager["payload"] == seat["payload"]
    assert await store.verify_audit_chain(run["id"])
    with pytest.raises(NotFoundError):
        await store.record_turn("no-such-run", **turn)


async def test_a_new_chain_under_the_runs_id_logs_its_own_turns_usage(store) -> None:
    """Another chain of executions under the run's id (a new start; a reset
    or continue-as-new keeps its chain) asks the model afresh, as its journal
    is its own: those tokens were spent, and the log counts them. Keyed by
    turn alone, the second chain's usage was taken for the first's and
    dropped, and the run's logged usage fell short of what it spent."""
    run = await new_run(store)
    turn = {"seat": "seat-1", "round_number": 1, "model": "m"}
    first = {**turn, "prompt_tokens": 100, "completion_tokens": 20, "chain": "c1"}
    second = {**turn, "prompt_tokens": 300, "completion_tokens": 40, "chain": "c2"}
    assert await store.record_turn(run["id"], **first)
    assert not await store.record_turn(run["id"], **first)  # the same chain's turn again
    assert await store.record_turn(run["id"], **second)
    assert not await store.record_turn(run["id"], **second)
    logged = [e["payload"] for e in await usage_events(store, run["id"])]
    assert [(p["prompt_tokens"], p["chain"]) for p in logged] == [(100, "c1"), (300, "c2")]
    assert await store.verify_audit_chain(run["id"])
    # A chain is a run id: one that is not text, or far too long for one, is
    # refused the same way on both databases, and nothing is logged.
    for hostile in ("c" * 200, "", 7):
        with pytest.raises(InvalidInputError):
            await store.record_turn(run["id"], **{**first, "chain": hostile})
    assert len(await usage_events(store, run["id"])) == 2


async def test_keeping_a_turn_of_a_run_that_is_not_there_keeps_nothing(store) -> None:
    """The insert fails with its commit not made (on SQLite they go in one
    trip), and the next keep goes through."""
    turn = {"run_id": "no-such-run", "role": "seat", "seat": "seat-1", "round_number": 1}
    with pytest.raises(exc.IntegrityError):
        await store.keep_turn(**turn, response=answer(1))
    assert await store.kept_turn(**turn) is None
    run = await new_run(store)
    assert (await store.keep_turn(**{**turn, "run_id": run["id"]}, response=answer(2)))[1]


def taking(run_id: str, execution: str, attempt: int) -> ActivityEnvironment:
    env = ActivityEnvironment()
    env.info = dataclasses.replace(
        env.info, workflow_id=run_id, workflow_run_id=execution, attempt=attempt
    )
    return env


@pytest.mark.parametrize(
    ("execution", "attempt", "asked"),
    [
        ("first", 1, 1),  # the chain's first execution, a first attempt: asked
        ("first", 2, 0),  # a retry: read first, not asked
        ("after-a-reset", 1, 0),  # another execution of the chain: read first
    ],
)
async def test_a_turn_already_kept_gives_its_answer_whether_or_not_it_was_read_first(
    store, monkeypatch, execution, attempt, asked
) -> None:
    """take_turn reads the journal before asking the model only where an
    answer may be kept already (a retry, an execution after the chain's
    first): a turn's first attempt in the chain's first execution is asked
    without the read. Wherever the read is left out, the kept answer still
    wins over the new one."""
    asks = []
    respond = ScriptedModel.respond

    async def counted(self, request):  # type: ignore[no-untyped-def]
        asks.append(request.seat)
        return await respond(self, request)

    monkeypatch.setattr(ScriptedModel, "respond", counted)
    run = await new_run(store)
    turn = {"run_id": run["id"], "role": "seat", "seat": "seat-1", "round_number": 1}
    usage = {"prompt_tokens": 100, "completion_tokens": 20}
    first = {
        "text": "the first answer",
        "tool_calls": [{"id": "c-1", "name": "ticket_update", "arguments": {"k": SECRET_ARG}}],
        "usage": usage,
    }
    await store.keep_turn(**turn, chain="first", response=first)
    await store.record_turn(
        run["id"], seat="seat-1", round_number=1, model="m", chain="first", **usage
    )
    taken = await taking(run["id"], execution, attempt).run(
        RunActivities(store, ToolRegistry(), authority=TRUSTING).take_turn,
        TakeTurnInput(
            run_id=run["id"], seat="seat-1", round=1, role="seat", model="scripted",
            task_text="t", chain="first",
            script={"turns": [{"seat": "seat-1", "round": 1, "text": "a new answer"}]},
        ),
    )  # fmt: skip
    assert len(asks) == asked
    assert taken.response.text == "the first answer"
    assert [c.arguments for c in taken.response.tool_calls] == [{"k": SECRET_ARG}]
    assert len(await usage_events(store, run["id"])) == 1


async def test_take_turn_logs_each_chains_usage_and_a_retrys_once(store, monkeypatch) -> None:
    """Through the activity: the first chain's turn, its retry, then the
    same turn of a second chain under the run's id. The retry gets the kept
    answer and logs nothing more; the second chain asks again and its
    tokens are logged beside the first's."""
    respond = ScriptedModel.respond
    spent = iter([100, 300])

    async def with_usage(self, request):  # type: ignore[no-untyped-def]
        answer = await respond(self, request)
        return answer.model_copy(
            update={"usage": TokenUsage(prompt_tokens=next(spent), completion_tokens=5)}
        )

    monkeypatch.setattr(ScriptedModel, "respond", with_usage)
    run = await new_run(store)
    activities = RunActivities(store, ToolRegistry(), authority=TRUSTING)
    for chain, attempt in (("first", 1), ("first", 2), ("second", 1)):
        await taking(run["id"], chain, attempt).run(
            activities.take_turn,
            TakeTurnInput(
                run_id=run["id"], seat="seat-1", round=1, role="seat", model="scripted",
                task_text="t", chain=chain,
            ),
        )  # fmt: skip
    logged = [e["payload"] for e in await usage_events(store, run["id"])]
    assert [(p["chain"], p["prompt_tokens"]) for p in logged] == [("first", 100), ("second", 300)]


async def test_a_keep_cancelled_anywhere_keeps_its_answer_whole_or_not_at_all(store) -> None:
    """On SQLite the insert and its commit go in one trip: a caller cancelled
    while it runs must not be told nothing was kept when it was. Store calls
    run to their own end (tests/test_store_cancellation.py), so the answer a
    cancelled keep sent is the kept one, or none was kept and the next keep's
    is; the database is never left holding its write lock."""
    run = await new_run(store)
    for n in range(30):
        turn = {"run_id": run["id"], "role": "seat", "seat": "seat-1", "round_number": n}
        call = asyncio.ensure_future(store.keep_turn(**turn, response=answer(n)))
        await asyncio.sleep(0.0005 * (n % 7))
        call.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await call
        again, ours = await asyncio.wait_for(store.keep_turn(**turn, response=answer(99)), 5)
        assert again["text"] == ("answer 99" if ours else f"answer {n}")
        assert await store.kept_turn(**turn) == again
