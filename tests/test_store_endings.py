"""How runs end in the store: closed workflows settled, writes withdrawn,
extensions that beat the expiry timer, usage counted once, large results kept."""

from __future__ import annotations

import pytest

from roundtable.store import InvalidInputError, NotFoundError
from roundtable.store.errors import AttemptMayBeRunningError
from tests.helpers import new_action, new_run, target_for
from tests.test_store_approvals import waiting_action


async def test_extension_committed_before_the_old_timer_fires_is_never_expired(store) -> None:
    """The workflow's timer was armed for the old deadline; an extension got
    in first. Expiring against the timer's deadline must leave it pending."""
    run = await new_run(store)
    _, approval = await waiting_action(store, run)
    armed_for = approval["expires_at"]
    extended = await store.extend_approval(approval["id"], 600, "op-1", 3600)
    assert not await store.expire_approval(approval["id"], deadline=armed_for)
    assert (await store.get_approval(approval["id"]))["status"] == "pending"
    # Armed for the new deadline, it expires (the timer is authoritative).
    assert await store.expire_approval(approval["id"], deadline=extended["expires_at"])
    assert (await store.get_approval(approval["id"]))["status"] == "expired"


async def test_withdrawing_a_write_when_its_run_ends(store) -> None:
    run = await new_run(store)
    waiting, approval = await waiting_action(store, run, key="w")
    approved = await new_action(store, run, key="a", target_key=target_for("a"))
    running = await new_action(store, run, key="x", target_key=target_for("x"))
    assert await store.claim_action_for_execution(running["id"], 30) == "claimed"

    assert (await store.withdraw_action(waiting["id"], "run_ended"))["status"] == "rejected"
    stored = await store.get_approval(approval["id"])
    assert stored["status"] == "withdrawn" and stored["decision_reason"] == "run_ended"
    assert stored["decided_by"] is None  # nobody decided
    assert (await store.withdraw_action(approved["id"], "run_ended"))["result"] == {
        "error_code": "run_ended"
    }
    assert await store.claim_action_for_execution(approved["id"], 30) == "already_finished"
    # An executing write is never withdrawn: only its own attempt can settle it.
    assert (await store.withdraw_action(running["id"], "run_ended"))["status"] == "executing"
    types = [e["event_type"] for e in await store.list_events(run["id"])]
    assert types.count("approval.withdrawn") == 1 and types.count("action.rejected") == 2


async def test_settling_a_run_whose_workflow_closed(store) -> None:
    run = await new_run(store)
    await store.set_run_status(run["id"], "waiting_input")
    waiting, approval = await waiting_action(store, run, key="w")
    running = await new_action(store, run, key="x", target_key=target_for("x"))
    assert await store.claim_action_for_execution(running["id"], 30) == "claimed"
    failure = {"code": "workflow_terminated", "message": "terminated by ops: stuck"}

    settled = await store.settle_closed_run(run["id"], "terminated", failure)
    assert settled["run"]["status"] == "terminated"
    assert settled["run"]["failure"] == failure
    assert settled["unknown_actions"] == [running["id"]]
    assert settled["withdrawn_actions"] == [waiting["id"]]
    lost = await store.get_action(running["id"])
    assert lost["status"] == "unknown"
    assert lost["result"] == {"error_code": "workflow_closed_during_execution"}
    assert (await store.get_approval(approval["id"]))["status"] == "withdrawn"
    # Its attempt may still be running somewhere until the lease runs out.
    with pytest.raises(AttemptMayBeRunningError):
        await store.reconcile_action(running["id"], "failed", "op-1", "looked")

    again = await store.settle_closed_run(run["id"], "terminated", failure)
    assert again["unknown_actions"] == [] and again["withdrawn_actions"] == []
    assert await store.verify_audit_chain(run["id"])
    with pytest.raises(InvalidInputError):
        await store.settle_closed_run(run["id"], "running")


async def test_a_failed_run_says_why(store) -> None:
    run = await new_run(store)
    await store.set_run_status(run["id"], "running")
    failed = await store.set_run_status(
        run["id"], "failed", {"code": "model_error", "message": "401 from the model vendor"}
    )
    assert failed["failure"] == {"code": "model_error", "message": "401 from the model vendor"}
    with pytest.raises(InvalidInputError):
        await store.set_run_status(run["id"], "failed", {"message": "no code"})


async def test_a_stalled_run_recovers_and_forgets_why_it_stalled(store) -> None:
    run = await new_run(store)
    await store.set_run_status(run["id"], "running")
    stalled = await store.set_run_status(
        run["id"], "stalled", {"code": "workflow_task_failing", "message": "no key 'k2'"}
    )
    assert stalled["status"] == "stalled" and stalled["failure"]["code"] == "workflow_task_failing"
    recovered = await store.set_run_status(run["id"], "waiting_input")
    assert recovered["failure"] is None


async def test_a_retried_turn_counts_its_usage_once(store) -> None:
    run = await new_run(store)
    usage = {"model": "m", "prompt_tokens": 10, "completion_tokens": 5}
    assert await store.record_turn(run["id"], seat="seat-1", round_number=1, **usage)
    assert not await store.record_turn(run["id"], seat="seat-1", round_number=1, **usage)
    assert await store.record_turn(run["id"], seat="seat-1", round_number=2, **usage)
    assert await store.record_turn(
        run["id"], seat="seat-1", round_number=2, role="manager", **usage
    )
    turns = [e for e in await store.list_events(run["id"]) if e["event_type"] == "turn.completed"]
    assert len(turns) == 3
    assert await store.verify_audit_chain(run["id"])


async def test_large_tool_results_are_kept_encrypted_by_reference(store) -> None:
    run = await new_run(store)
    secretish = "CANARY-in-a-large-result " * 1000
    ref = await store.save_tool_result(
        run_id=run["id"], seat="seat-1", call_id="c1", content={"text": secretish}
    )
    kept = await store.get_tool_result(ref)
    assert kept["content"] == {"text": secretish} and kept["run_id"] == run["id"]
    assert kept["size_bytes"] > len(secretish)
    async with store.engine.connect() as connection:
        raw = (await connection.exec_driver_sql("SELECT content_encrypted FROM tool_results")).all()
    assert "CANARY" not in str(raw)
    with pytest.raises(NotFoundError):
        await store.get_tool_result("result-nope")


async def test_what_an_attempt_reports_after_it_was_made_unknown_is_kept(store) -> None:
    """Found in review: a late definite result was dropped without a trace, so
    the operator reconciled blind."""
    run = await new_run(store)
    action = await new_action(store, run, key="late", target_key=target_for("late"))
    assert await store.claim_action_for_execution(action["id"], 30) == "claimed"
    token = (await store.get_action(action["id"]))["fencing_token"]
    # The workflow gave up on it (a heartbeat timeout): unknown, the lease left running.
    assert await store.record_action_terminal_result(action["id"], "unknown", {"error_code": "x"})
    # Then the attempt comes back with a definite answer.
    assert not await store.record_action_terminal_result(
        action["id"],
        "succeeded",
        {"external_object_id": "T-7"},
        fencing_token=token,
        attempt_over=True,
    )
    stored = await store.get_action(action["id"])
    assert stored["status"] == "unknown"  # still for a person to settle...
    assert stored["result"]["attempt_reported"] == {
        "status": "succeeded",
        "result": {"external_object_id": "T-7"},
    }  # ...with what the attempt said
    types = [e["event_type"] for e in await store.list_events(run["id"])]
    assert types[-2:] == ["action.attempt_reported", "action.attempt_ended"]
    settled = await store.reconcile_action(action["id"], "succeeded", "op-1", "as reported")
    assert settled["status"] == "succeeded"


async def test_a_database_error_never_quotes_its_bound_values(store) -> None:
    """A failed statement's message reaches logs and Temporal failures; once it
    carried the values bound to it ("[parameters: ...]")."""
    from sqlalchemy import text
    from sqlalchemy.exc import DBAPIError

    async with store.db.transaction() as session:
        with pytest.raises(DBAPIError) as failed:
            await session.execute(
                text("INSERT INTO no_such_table (secret) VALUES (:secret)"),
                {"secret": "SEKRET-value"},
            )
    assert "SEKRET" not in str(failed.value)


async def test_a_webhook_delivery_id_as_long_as_real_ones_is_recorded(store) -> None:
    """Found by the chaos harness on PostgreSQL: event ids run to about 170
    characters and delivery_id held 64, so every attempt's record failed and
    the delivery was retried (and re-sent) eight times."""
    run = await store.ensure_run(run_id="run-" + "a" * 24, user_id="u", task_text="t")
    long_id = f"{run['id']}:approval.requested:{'b' * 36}:{'c' * 36}"
    await store.record_webhook_attempt(
        delivery_id=long_id,
        run_id=run["id"],
        event_type="approval.requested",
        url="http://receiver/… #12345678",
        attempt=1,
        status_code=200,
        error=None,
        delivered=True,
    )
    (recorded,) = await store.list_webhook_deliveries(run_id=run["id"])
    assert recorded["delivery_id"] == long_id
