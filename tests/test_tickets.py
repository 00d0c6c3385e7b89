"""The demo ticket system is the ground truth: its log must never lie.

Once seen on main: a finish refused for a stale fencing token was recorded in
the same transaction the refusal rolled back, so the log showed the write
`started` for ever, as if it might have happened.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from roundtable.store.engine import create_engine_for
from roundtable.tools import tickets as tickets_module
from roundtable.tools.registry import ToolContext, ToolDefiniteFailure
from roundtable.tools.tickets import TicketSystem, TicketUpdateArgs, _Base


def writer(key: str, token: int) -> ToolContext:
    return ToolContext(run_id="r", seat="s", idempotency_key=key, fencing_token=token)


ARGS = TicketUpdateArgs(tenant_id="acme", ticket_id="T-1", fields={"owner": "x"})


@pytest.fixture
async def tickets(database_url: str):  # type: ignore[no-untyped-def]
    system = await TicketSystem.open(database_url, write_delay_seconds=0.5)
    yield system
    await system.close()


async def test_a_stale_finish_is_logged_as_refused(tickets: TicketSystem) -> None:
    old = asyncio.create_task(tickets.update(ARGS, writer("old", 1)))
    await asyncio.sleep(0.1)  # the old writer has started and waits mid-write
    assert (await tickets.update(ARGS, writer("new", 2)))["ticket_id"] == "T-1"
    with pytest.raises(ToolDefiniteFailure) as refused:
        await old
    assert refused.value.code == "stale_fencing_token"
    log = {w["idempotency_key"]: w for w in await tickets.write_log()}
    assert log["old"]["outcome"] == "rejected_stale" and log["old"]["finished_at"]
    assert log["new"]["outcome"] == "applied"


async def test_a_stale_start_is_logged_as_refused_and_stays_refused(tickets: TicketSystem) -> None:
    await tickets.update(ARGS, writer("new", 5))
    for _ in range(2):  # asked again with the same key: the same refusal
        with pytest.raises(ToolDefiniteFailure):
            await tickets.update(ARGS, writer("late", 4))
    log = {w["idempotency_key"]: w for w in await tickets.write_log()}
    assert log["late"]["outcome"] == "rejected_stale" and log["late"]["finished_at"]
    assert (await tickets.read("acme", "T-1"))["fields"] == {"owner": "x"}


async def test_a_write_whose_caller_went_away_is_logged_as_abandoned(
    tickets: TicketSystem,
) -> None:
    call = asyncio.create_task(tickets.update(ARGS, writer("gone", 1)))
    await asyncio.sleep(0.1)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    (entry,) = await tickets.write_log()
    assert entry["outcome"] == "abandoned" and entry["finished_at"]
    assert (await tickets.read("acme", "T-1") or {}).get("fields", {}) == {}  # never applied


async def test_a_repeated_key_is_answered_once_and_counted(tickets: TicketSystem) -> None:
    """The ticket system absorbs a repeat (nothing written again), but its log
    counts it: the invariant checker must see a write Roundtable sent twice."""
    first = await tickets.update(ARGS, writer("k", 1))
    again = await tickets.update(ARGS, writer("k", 1))
    assert again == {**first, "replayed": True}
    (entry,) = await tickets.write_log()
    assert entry["outcome"] == "applied" and entry["arrivals"] == 2


async def test_a_log_made_before_arrivals_gets_the_column(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from sqlalchemy import text

    url = f"sqlite+aiosqlite:///{tmp_path / 'old.db'}"
    system = await TicketSystem.open(url)
    async with system.engine.begin() as conn:
        await conn.execute(text("ALTER TABLE demo_ticket_writes DROP COLUMN arrivals"))
    await system.close()
    system = await TicketSystem.open(url)
    try:
        await system.update(ARGS, writer("k", 1))
        (entry,) = await system.write_log()
        assert entry["arrivals"] == 1
    finally:
        await system.close()


async def test_workers_opening_the_ticket_system_at_once_all_open(postgres_url: str) -> None:
    """The scale bench starts its workers together: two CREATE TABLEs of one
    name raced on PostgreSQL and the loser's worker failed to start."""
    for _ in range(3):
        systems = await asyncio.gather(*(TicketSystem.open(postgres_url) for _ in range(4)))
        for system in systems:
            await system.engine.dispose()
        engine = create_engine_for(postgres_url)
        async with engine.begin() as conn:
            await conn.run_sync(lambda sync: _Base.metadata.drop_all(sync))
        await engine.dispose()


def _lock_later(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every concurrent caller reads the log before any of them locks the
    ticket: the widest window two arrivals of one key can race in."""
    locking = tickets_module._locked_ticket

    async def later(conn, args):  # type: ignore[no-untyped-def]
        await asyncio.sleep(0.3)
        return await locking(conn, args)

    monkeypatch.setattr(tickets_module, "_locked_ticket", later)


async def test_arrivals_of_one_key_at_once_are_answered_and_counted(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found in review: on PostgreSQL the log was read before the ticket was
    locked, so a second arrival racing the first failed on the log's unique
    key and was never counted: a write Roundtable sent twice at once, the
    very thing ``arrivals`` is for, left no trace."""
    _lock_later(monkeypatch)
    system = await TicketSystem.open(database_url)
    try:
        fresh = TicketUpdateArgs(tenant_id="acme", ticket_id="T-race", fields={"a": 1})
        answers = await asyncio.gather(
            *(system.update(fresh, writer("twice", 1)) for _ in range(2)), return_exceptions=True
        )
        assert not [a for a in answers if isinstance(a, BaseException)], answers
        (entry,) = await system.write_log()
        assert entry["arrivals"] == 2 and entry["outcome"] == "applied"
    finally:
        await system.close()


async def test_first_writes_of_one_new_ticket_at_once_all_apply(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _lock_later(monkeypatch)
    system = await TicketSystem.open(database_url)
    try:
        fresh = TicketUpdateArgs(tenant_id="acme", ticket_id="T-new", fields={"a": 1})
        answers = await asyncio.gather(
            *(system.update(fresh, writer(f"k{n}", n + 1)) for n in range(4)),
            return_exceptions=True,
        )
        # Each applies or is refused as stale: none fails on the ticket's creation.
        failures = [a for a in answers if isinstance(a, BaseException)]
        assert all(isinstance(f, ToolDefiniteFailure) for f in failures), failures
        outcomes = sorted(w["outcome"] for w in await system.write_log())
        assert "applied" in outcomes and set(outcomes) <= {"applied", "rejected_stale"}
    finally:
        await system.close()


async def test_a_call_cancelled_while_it_starts_is_logged_as_abandoned(
    tickets: TicketSystem,
) -> None:
    """Found in review: _start runs to completion and the cancel was raised
    outside the handler that closes the entry, so it said "started" for ever
    for a write that never applied and never will."""
    call = asyncio.create_task(tickets.update(ARGS, writer("cut", 1)))
    await asyncio.sleep(0)  # _start is under way; its caller goes away
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    (entry,) = await tickets.write_log()
    assert entry["outcome"] == "abandoned" and entry["finished_at"]


async def test_a_repeat_cancelled_while_it_starts_leaves_the_first_call_alone(
    tickets: TicketSystem,
) -> None:
    first = asyncio.create_task(tickets.update(ARGS, writer("k", 1)))
    await asyncio.sleep(0.1)  # the first call has started and waits mid-write
    repeat = asyncio.create_task(tickets.update(ARGS, writer("k", 1)))
    await asyncio.sleep(0)
    repeat.cancel()
    with pytest.raises(asyncio.CancelledError):
        await repeat
    await first
    (entry,) = await tickets.write_log()
    assert entry["outcome"] == "applied" and entry["arrivals"] == 2


async def test_a_finish_with_no_entry_in_the_log_applies_nothing(tickets: TicketSystem) -> None:
    """Found in review: the log is the ground truth, and a finish that found
    no entry to end still applied the write, unlogged."""
    with pytest.raises(RuntimeError, match="no write log entry"):
        await tickets._finish(ARGS, writer("never-started", 1), lambda t: t.fields.update(a=1))
    assert await tickets.read("acme", "T-1") is None
    assert await tickets.write_log() == []


async def test_a_write_changes_its_own_ticket_and_no_other(tickets: TicketSystem) -> None:
    """A write's statements are built once and told their ticket by
    parameters: a key that failed to bind would change every ticket."""
    other = TicketUpdateArgs(tenant_id="acme", ticket_id="T-2", fields={"owner": "y"})
    same_id_elsewhere = TicketUpdateArgs(tenant_id="globex", ticket_id="T-1", fields={"b": 2})
    await tickets.update(other, writer("o", 7))
    await tickets.update(same_id_elsewhere, writer("g", 3))
    await tickets.update(ARGS, writer("mine", 9))
    assert await tickets.fence(ARGS, writer("mine-again", 20))
    assert (await tickets.read("acme", "T-2"))["fields"] == {"owner": "y"}
    assert (await tickets.read("globex", "T-1"))["fields"] == {"b": 2}
    assert (await tickets.read("acme", "T-1"))["fields"] == {"owner": "x"}
    # The fence raised T-1's token alone: the others still take their own next writers.
    await tickets.update(other, writer("o2", 8))
    await tickets.update(same_id_elsewhere, writer("g2", 4))
    with pytest.raises(ToolDefiniteFailure):
        await tickets.update(ARGS, writer("mine-late", 20))
    log = {w["idempotency_key"]: w for w in await tickets.write_log()}
    assert {k: log[k]["outcome"] for k in ("o", "g", "mine", "o2", "g2", "mine-late")} == {
        "o": "applied",
        "g": "applied",
        "mine": "applied",
        "o2": "applied",
        "g2": "applied",
        "mine-late": "rejected_stale",
    }
    assert all(w["arrivals"] == 1 for w in log.values())


async def test_a_change_naming_no_column_is_refused_and_applies_nothing(
    tickets: TicketSystem,
) -> None:
    """Found in review: a write's values go to a statement built once as
    parameters, and a name that is no column was ignored: the write was
    logged ``applied`` without it (built per call, SQLAlchemy refused it)."""

    def apply(ticket: Any) -> None:
        ticket.fields.update(a=1)
        ticket.priority = "high"

    with pytest.raises(ValueError, match=r"not \['priority'\]"):
        await tickets._write("update", ARGS, writer("k", 1), apply)
    assert (await tickets.read("acme", "T-1"))["fields"] == {}  # made by the start, unchanged
    (entry,) = await tickets.write_log()
    assert entry["outcome"] != "applied"


async def test_a_change_cannot_move_the_key_it_is_written_under(tickets: TicketSystem) -> None:
    await tickets.update(ARGS, writer("first", 1))

    def apply(ticket: Any) -> None:
        ticket.key_ticket = "T-2"

    with pytest.raises(ValueError, match="key_ticket"):
        await tickets._write("update", ARGS, writer("k", 2), apply)
    assert (await tickets.read("acme", "T-1"))["fields"] == {"owner": "x"}
    assert await tickets.read("acme", "T-2") is None
