"""A run's history stays bounded however many writes it makes: five hundred
writes, and no history of the run (it continues as new when the server
suggests it, between rounds) reaches ten thousand events. On the real dev
server, whose suggestion is the one production gets."""

from __future__ import annotations

from collections import Counter

import pytest

from tests.test_kept_snapshots import scheduled_inputs
from tests.workflow_harness import harness, script, ticket_call

ROUNDS, WRITES_PER_TURN = 50, 10  # 500 writes, ten at a time, each on its own ticket
HISTORY_BOUND = 10_000


@pytest.mark.timeout(600)
async def test_five_hundred_writes_keep_every_history_under_ten_thousand_events(tmp_path) -> None:
    turns = [
        (
            "seat-1",
            r,
            [ticket_call("ticket_comment", f"T-{r}-{i}") for i in range(WRITES_PER_TURN)],
        )
        for r in range(1, ROUNDS + 1)
    ]
    async with harness(tmp_path, dev_server=True) as h:
        handle = await h.start(
            task_text="many writes",
            seats=["seat-1"],
            manager=None,
            max_rounds=ROUNDS,
            write_policy="auto_approve_up_to:R1",
            script=script(*turns),
        )
        assert (await handle.result()).status == "completed"  # follows continue-as-new

        actions = await h.store.list_actions(handle.id)
        assert len(actions) == ROUNDS * WRITES_PER_TURN
        assert Counter(a["status"] for a in actions) == {"succeeded": len(actions)}
        assert {a["attempt_count"] for a in actions} == {1}
        writes = await h.tickets.write_log()
        assert len(writes) == len(actions)
        assert len({w["idempotency_key"] for w in writes}) == len(actions)  # each once

        runs = [w async for w in h.client.list_workflows(f"WorkflowId = '{handle.id}'")]
        sizes, named = [], set()
        digest = (await h.store.get_run(handle.id))["snapshot_digest"]
        for run in runs:
            one = h.client.get_workflow_handle(handle.id, run_id=run.run_id)
            sizes.append(len((await one.fetch_history()).events))
            # The kept snapshot's digest goes with the state into each run.
            turns = await scheduled_inputs(one, h.client.data_converter)
            named |= {t.get("tools_of") for t in turns}
        assert named == {digest}
        assert len(runs) >= 2, f"one history of {sizes} events: it never continued as new"
        assert max(sizes) < HISTORY_BOUND, sizes
