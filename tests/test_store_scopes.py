"""A namespace-wide write excludes every write in its namespace, and they it."""

from __future__ import annotations

import asyncio

import pytest

from roundtable.store import InvalidInputError
from tests.helpers import new_action, new_run, set_column, target_fields

WIDE = None  # an unusable key field: the key covers the whole namespace


async def claim(store, action) -> str:
    return await store.claim_action_for_execution(action["id"], lease_seconds=30)


async def test_wide_write_blocks_specific_writes_in_its_namespace_only(store) -> None:
    run = await new_run(store)
    wide = await new_action(store, run, key="wide", **target_fields(WIDE))
    assert wide["target_namespace_wide"] is True
    specific = await new_action(store, run, key="one", **target_fields("task-1"))
    elsewhere = await new_action(
        store, run, key="else", **target_fields("task-1", namespace="other")
    )

    assert await claim(store, wide) == "claimed"
    assert await claim(store, specific) == "target_busy"
    assert await claim(store, elsewhere) == "claimed"
    assert await store.record_action_terminal_result(wide["id"], "succeeded", {})
    assert await claim(store, specific) == "claimed"


async def test_specific_writes_block_a_wide_write(store) -> None:
    run = await new_run(store)
    first = await new_action(store, run, key="one", **target_fields("task-1"))
    second = await new_action(store, run, key="two", **target_fields("task-2"))
    wide = await new_action(store, run, key="wide", **target_fields(WIDE))
    assert await claim(store, first) == "claimed"
    assert await claim(store, second) == "claimed"  # distinct objects run side by side
    assert await claim(store, wide) == "target_busy"
    await store.record_action_terminal_result(first["id"], "succeeded", {})
    assert await claim(store, wide) == "target_busy"
    await store.record_action_terminal_result(second["id"], "failed", {})
    assert await claim(store, wide) == "claimed"


async def test_unknown_wide_write_needs_reconciliation_for_the_namespace(store) -> None:
    run = await new_run(store)
    wide = await new_action(store, run, key="wide", **target_fields(WIDE))
    assert await claim(store, wide) == "claimed"
    assert await store.record_action_terminal_result(
        wide["id"], "unknown", {"error_code": "x"}, attempt_over=True
    )
    specific = await new_action(store, run, key="one", **target_fields("task-1"))
    assert await claim(store, specific) == "target_reconciliation_required"
    await store.reconcile_action(wide["id"], "succeeded", "op", "checked")
    assert await claim(store, specific) == "claimed"


async def test_unknown_specific_write_blocks_a_wide_write(store) -> None:
    run = await new_run(store)
    specific = await new_action(store, run, key="one", **target_fields("task-1"))
    assert await claim(store, specific) == "claimed"
    await store.record_action_terminal_result(specific["id"], "unknown", {})
    wide = await new_action(store, run, key="wide", **target_fields(WIDE))
    assert await claim(store, wide) == "target_reconciliation_required"
    other = await new_action(store, run, key="two", **target_fields("task-2"))
    assert await claim(store, other) == "claimed"


@pytest.mark.parametrize("round_", range(3))
async def test_wide_and_specific_claims_racing_never_overlap(store, round_: int) -> None:
    """Different runs, so only the scope row can serialise them."""
    runs = [await new_run(store) for _ in range(4)]
    wide = await new_action(store, runs[0], key=f"wide-{round_}", **target_fields(WIDE))
    specifics = [
        await new_action(store, runs[i], key=f"s{i}-{round_}", **target_fields(f"task-{i}"))
        for i in range(1, 4)
    ]
    order = [wide, *specifics] if round_ % 2 == 0 else [*specifics, wide]
    outcomes = dict(
        zip(
            [a["id"] for a in order],
            await asyncio.gather(*(claim(store, a) for a in order)),
            strict=True,
        )
    )
    executing = {
        a["id"]
        for a in [wide, *specifics]
        if (await store.get_action(a["id"]))["status"] == "executing"
    }
    assert executing == {i for i, o in outcomes.items() if o == "claimed"}
    if wide["id"] in executing:
        assert executing == {wide["id"]}
    else:
        assert executing == {a["id"] for a in specifics}


async def test_namespace_wide_needs_a_scope(store) -> None:
    run = await new_run(store)
    fields = target_fields(WIDE)
    del fields["target_scope"]
    with pytest.raises(InvalidInputError):
        await new_action(store, run, key="w", **fields)
    with pytest.raises(InvalidInputError):
        await new_action(store, run, key="w", **{**target_fields(), "target_namespace_wide": 1})


async def test_fencing_tokens_grow_across_a_scope_not_only_per_key(store) -> None:
    """A namespace-wide write after three writes to one key of its namespace
    once got token 1 again: a ticket system comparing tokens could not tell the
    newer writer. Within a scope every claim now outranks every earlier one."""
    run = await new_run(store)
    tokens = []
    for index in range(3):
        one = await new_action(store, run, key=f"one-{index}", **target_fields("task-1"))
        assert await claim(store, one) == "claimed"
        tokens.append((await store.get_action(one["id"]))["fencing_token"])
        await store.record_action_terminal_result(one["id"], "succeeded", {})
    wide = await new_action(store, run, key="wide", **target_fields(WIDE))
    assert await claim(store, wide) == "claimed"
    tokens.append((await store.get_action(wide["id"]))["fencing_token"])
    await store.record_action_terminal_result(wide["id"], "succeeded", {})
    other = await new_action(store, run, key="other", **target_fields("task-2"))
    assert await claim(store, other) == "claimed"
    tokens.append((await store.get_action(other["id"]))["fencing_token"])
    elsewhere = await new_action(
        store, run, key="elsewhere", **target_fields("task-1", namespace="other")
    )
    assert await claim(store, elsewhere) == "claimed"
    assert tokens == [1, 2, 3, 4, 5]
    assert (await store.get_action(elsewhere["id"]))["fencing_token"] == 1  # its own scope


async def test_a_key_whose_own_counter_ran_ahead_of_its_scope_keeps_outranking(store) -> None:
    """A key claimed before scopes existed has its own counter ahead of its
    scope's: its next token is one past the larger of the two, and the scope
    follows it, so the next claim anywhere in the scope outranks it too."""
    from roundtable.store.schema import TargetFencingRow, TargetScopeRow

    run = await new_run(store)
    first = await new_action(store, run, key="first", **target_fields("task-1"))
    assert await claim(store, first) == "claimed"
    await store.record_action_terminal_result(first["id"], "succeeded", {})
    await set_column(
        store, TargetFencingRow, TargetFencingRow.target_key == first["target_key"], last_token=7
    )
    again = await new_action(store, run, key="again", **target_fields("task-1"))
    assert await claim(store, again) == "claimed"
    assert (await store.get_action(again["id"]))["fencing_token"] == 8
    await store.record_action_terminal_result(again["id"], "succeeded", {})
    neighbour = await new_action(store, run, key="neighbour", **target_fields("task-2"))
    assert await claim(store, neighbour) == "claimed"
    assert (await store.get_action(neighbour["id"]))["fencing_token"] == 9
    async with store.session_factory() as session:
        scope = await session.get(TargetScopeRow, first["target_scope"])
        assert scope.claims == 9


async def test_the_runs_woken_when_a_target_frees_are_its_waiters_and_overlaps(store) -> None:
    """Whom a freed target wakes (``runs_waiting_on_target``): runs with an
    approved write on the same key, or in its scope where one of the two is
    namespace-wide, the longest waiting first, at most ``limit``; never the
    write itself, another namespace's, or a write not approved."""
    holder_run, same_run, wide_run, other_run, late_run = [await new_run(store) for _ in range(5)]
    specific = await new_action(store, holder_run, key="holder", **target_fields("task-1"))
    same = await new_action(store, same_run, key="same", **target_fields("task-1"))
    wide = await new_action(store, wide_run, key="wide", **target_fields(WIDE))
    # Neither woken by a specific key: a sibling key, and another namespace.
    await new_action(store, other_run, key="sib", **target_fields("task-2"))
    await new_action(store, other_run, key="ns", **target_fields("task-1", namespace="other"))
    # Not approved: nothing to wake.
    await new_action(store, late_run, key="w", status="waiting_approval", **target_fields("task-1"))

    assert await store.runs_waiting_on_target(specific) == [same_run["id"], wide_run["id"]]
    assert await store.runs_waiting_on_target(specific, limit=1) == [same_run["id"]]
    # A wide write's target frees every approved write in its namespace.
    assert await store.runs_waiting_on_target(wide) == [
        holder_run["id"],
        same_run["id"],
        other_run["id"],
    ]
    # A target with no scope: its key only.
    bare = await new_action(store, holder_run, key="bare", target_key=same["target_key"])
    assert bare["target_scope"] is None
    assert await store.runs_waiting_on_target(bare) == [holder_run["id"], same_run["id"]]
