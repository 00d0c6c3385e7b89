"""An operator's decision, extension or edited approval is applied once,
however often its local activity is tried (from the reviews of 2026-12-06;
plain decisions since 2026-12-07).

A local activity whose store call is cancelled (its start-to-close timeout,
BOOKKEEPING, while the call waits for SQLite's writer queue or a starved
pool's checkout) still commits: the store's public calls run to their end
(roundtable/completion.py) and only then raise CancelledError. The attempt
fails with the change recorded, and Temporal retries it. So each change is
recorded under the id of the update that asked for it (``request_key``), and
a retry that finds its own record answers with it: the deadline moves once,
the seat is told of the edits, the operator is told the decision stands.

Also: what extend and approve_with_edits answer is what a fresh read of the
approval says, field by field, on both databases.
"""

from __future__ import annotations

import asyncio
import dataclasses
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

import activities.write_activities as write_activities
from activities.write_activities import WriteActivities
from roundtable.models import Decision, ExtendInput, RecordDecisionInput
from roundtable.permissions import MAX_ATTESTATION_AGE, Decider, attest
from roundtable.security import Target
from roundtable.store.errors import ConflictError
from roundtable.tools.registry import ToolRegistry
from tests.helpers import new_run, waiting_action
from tests.test_decisions_answered_from_their_commit import approve_edited, seat_was_told_of_edits
from tests.workflow_harness import TRUSTING


async def _pending(store: Any, key: str) -> dict[str, Any]:
    run = await new_run(store)
    action = await waiting_action(store, run, key, datetime.now(UTC) + timedelta(hours=1))
    return action


def _same(answer: dict[str, Any], fresh: dict[str, Any]) -> None:
    for name, value in fresh.items():
        got = answer[name]
        assert got == value, (name, got, value)
        assert type(got) is type(value) or (isinstance(got, str) and isinstance(value, str)), (
            name,
            type(got),
            type(value),
        )
        if isinstance(value, datetime):
            assert got.tzinfo is not None and got.utcoffset() == value.utcoffset(), name


async def test_extension_answer_is_what_a_fresh_read_says(store) -> None:
    action = await _pending(store, "ext-compare")
    # An odd number of seconds, so microseconds are in play.
    answer = await store.extend_approval(
        action["approval_id"],
        1234.567891,
        "op-1",
        10_000,
        max_extensions=5,
        max_total_seconds=100_000,
    )
    fresh = await store.get_approval(action["approval_id"])
    _same(answer, fresh)
    assert set(answer) == set(fresh)


async def test_edited_answer_is_what_a_fresh_read_says(store) -> None:
    action = await _pending(store, "edit-compare")
    decided, _ = await store.approve_with_edits(
        action["approval_id"],
        "op-1",
        "why",
        None,
        {"tenant_id": "tenant-a", "object_id": "x"},
        Target(key="k-edit", scope=None, namespace_wide=False),
    )
    fresh = await store.get_approval(action["approval_id"])
    _same({k: decided[k] for k in fresh}, fresh)
    assert decided["action_status"] == (await store.get_action(action["id"]))["status"]
    assert type(decided["status"]) is str or decided["status"] == fresh["status"]


async def _until_queued(queue: Any) -> None:
    """Until a writer waits for SQLite's writer queue (it has no event to
    wait on: its waiters are polled)."""
    while not queue._waiters:  # noqa: ASYNC110
        await asyncio.sleep(0.01)


async def _cancelled_while_queued(store: Any, run_activity: Any) -> None:
    """Run the activity while another writer holds SQLite's writer queue,
    cancel it there (as the local activity's start-to-close timeout does),
    then let the writer go. Returns once the attempt has ended."""
    env = ActivityEnvironment()
    queue = store.db._local_writer
    await queue.acquire()
    try:
        attempt = asyncio.create_task(run_activity(env))
        await _until_queued(queue)
        env.cancel()
        await asyncio.sleep(0.05)
    finally:
        queue.release()
    with pytest.raises(asyncio.CancelledError):
        await attempt  # the attempt failed: Temporal will retry it


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
async def test_an_extension_cancelled_by_its_timeout_is_applied_once(store) -> None:
    action = await _pending(store, "ext-cancel")
    approval_id = action["approval_id"]
    first = (await store.get_approval(approval_id))["expires_at"]
    writes = WriteActivities(store, ToolRegistry(), authority=TRUSTING)
    # As the workflow sends it: keyed by the update that asked.
    inp = ExtendInput(
        approval_id=approval_id, seconds=600, extended_by="op-1", request_key="update-1"
    )

    await _cancelled_while_queued(store, lambda env: env.run(writes.extend_approval, inp))
    # What the cancelled attempt left: the extension, committed.
    assert (await store.get_approval(approval_id))["expires_at"] == first + timedelta(seconds=600)
    await ActivityEnvironment().run(writes.extend_approval, inp)  # Temporal's retry
    now = (await store.get_approval(approval_id))["expires_at"]
    extended = [
        e
        for e in await store.list_events(action["run_id"])
        if e["event_type"] == "approval.extended"
    ]
    assert len(extended) == 1, [e["payload"] for e in extended]
    assert now == first + timedelta(seconds=600)


@pytest.mark.timeout(300)
async def test_a_timed_out_extension_is_applied_once_in_a_run(tmp_path, monkeypatch) -> None:
    from roundtable.models import ExtendOutput
    from tests.workflow_harness import harness, script, shorten_bookkeeping, ticket_call
    from workflows.roundtable import RoundtableWorkflow

    bookkeeping = shorten_bookkeeping(monkeypatch)
    calls = script(("seat-1", 1, [ticket_call("ticket_update", "T-1")]))
    async with harness(tmp_path) as h:
        handle = await h.start(task_text="t", script=calls, approval_timeout_seconds=3600)
        state = await h.wait_for(handle, lambda s: bool(s.pending_approvals))
        (approval_id,) = state.pending_approvals
        first = (await h.store.get_approval(approval_id))["expires_at"]
        queue = h.store.db._local_writer
        await queue.acquire()  # a slow writer holds SQLite's queue past BOOKKEEPING
        try:
            update = asyncio.create_task(
                handle.execute_update(
                    RoundtableWorkflow.extend_approval,
                    ExtendInput(approval_id=approval_id, seconds=600, extended_by="op-1"),
                    result_type=ExtendOutput,
                )
            )
            await _until_queued(queue)
            # Past the local activity's start-to-close timeout (real time).
            await asyncio.sleep(bookkeeping.total_seconds() + 10)
        finally:
            queue.release()
        answered = await update
        now = (await h.store.get_approval(approval_id))["expires_at"]
        extended = [
            e
            for e in await h.store.list_events(handle.id)
            if e["event_type"] == "approval.extended"
        ]
        await handle.terminate()
        assert len(extended) == 1, [e["payload"] for e in extended]
        assert now == first + timedelta(seconds=600)
        assert answered.expires_at == now


@pytest.mark.timeout(300)
async def test_a_timed_out_edited_approval_is_answered_and_told(tmp_path, monkeypatch) -> None:
    from tests.workflow_harness import harness, script, shorten_bookkeeping, ticket_call

    bookkeeping = shorten_bookkeeping(monkeypatch)
    calls = [ticket_call("ticket_update", "T-1", fields={"priority": "low"})]
    async with harness(tmp_path) as h:
        handle = await h.start(
            task_text="t", script=script(("seat-1", 1, calls)), approval_timeout_seconds=3600
        )
        state = await h.wait_for(handle, lambda s: bool(s.pending_approvals))
        (approval_id,) = state.pending_approvals
        queue = h.store.db._local_writer
        await queue.acquire()
        try:
            update = asyncio.create_task(approve_edited(handle, approval_id))
            await _until_queued(queue)
            await asyncio.sleep(bookkeeping.total_seconds() + 10)
        finally:
            queue.release()
        answer = await update  # the operator's own decision stands: not a conflict
        assert answer == "approved"
        assert (await h.result(handle)).status == "completed"
        await seat_was_told_of_edits(h, handle)


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
async def test_two_long_update_ids_are_two_requests(store: Any) -> None:
    """Update ids go into the key as their digest: two that share their
    first 250 characters are still two requests (cut to the column's 255,
    the second was taken for the first, and changed nothing)."""
    run = await new_run(store)
    action = await waiting_action(store, run, "long-ids", datetime.now(UTC) + timedelta(hours=1))
    approval_id = action["approval_id"]
    first = (await store.get_approval(approval_id))["expires_at"]
    prefix = "client-chosen-update-id-" + "x" * 240
    for n in (1, 2):
        await store.extend_approval(
            approval_id, 60, "op-1", 3600, max_extensions=5, request_key=f"{prefix}-{n}"
        )
    assert (await store.get_approval(approval_id))["expires_at"] == first + timedelta(seconds=120)


def _past_the_attestations_age(monkeypatch: pytest.MonkeyPatch) -> None:
    """From now on the activities' clock reads a minute past the age at
    which an attestation made now is refused as stale."""
    later = datetime.now(UTC) + MAX_ATTESTATION_AGE + timedelta(minutes=1)

    class _Later(datetime):
        @classmethod
        def now(cls, tz: Any = None) -> datetime:  # type: ignore[override]
            return later

    monkeypatch.setattr(write_activities, "datetime", _Later)


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
async def test_a_retry_past_the_attestations_age_answers_as_recorded(
    store: Any, action_secret: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A local activity is retried without limit while the database is
    starved: a retry after the attestation's ten minutes must answer with
    the extension its first attempt recorded, not refuse it as stale (the
    operator would then send it again, under a new update id, and it would
    extend twice)."""
    run = await new_run(store)
    action = await waiting_action(store, run, "att-retry", datetime.now(UTC) + timedelta(hours=1))
    approval_id = action["approval_id"]
    writes = WriteActivities(store, ToolRegistry(), authority=TRUSTING)
    sent = attest(
        ExtendInput(approval_id=approval_id, seconds=600, extended_by="op-1"),
        Decider(user_id="op-1", role="operator"),
        datetime.now(UTC),
    )
    keyed = sent.model_copy(update={"request_key": "update-1"})  # as the workflow sends it
    first = await ActivityEnvironment().run(writes.extend_approval, keyed)
    _past_the_attestations_age(monkeypatch)
    again = await ActivityEnvironment().run(writes.extend_approval, keyed)
    assert again.expires_at == first.expires_at
    assert (await store.get_approval(approval_id))["expires_at"] == first.expires_at
    # A new request with the same stale attestation is still refused.
    with pytest.raises(ApplicationError, match="attestation_expired"):
        fresh_key = sent.model_copy(update={"request_key": "update-2"})
        await ActivityEnvironment().run(writes.extend_approval, fresh_key)


async def test_a_decision_asked_again_by_its_request_answers_as_it_stands(store: Any) -> None:
    """The decision's own request, asked again after its first attempt
    committed, changes nothing and is answered with the approval as it
    stands (what a fresh read says), not with a conflict. Any other request
    on the decided approval is the conflict it always was."""
    action = await _pending(store, "plain-again")
    approval_id = action["approval_id"]
    first = await store.decide_approval(
        approval_id, "approved", "op-1", "looks right", request_key="update-1"
    )
    again = await store.decide_approval(
        approval_id, "approved", "op-1", "looks right", request_key="update-1"
    )
    fresh = await store.get_approval(approval_id)
    _same({name: again[name] for name in fresh}, fresh)
    assert again["action_status"] == first["action_status"] == "approved"
    assert again["run_status"] == first["run_status"]
    events = [e["event_type"] for e in await store.list_events(action["run_id"])]
    assert events.count("approval.approved") == events.count("action.approved") == 1
    # Another request, the other decision under the same request, no request.
    for key, decision in (("update-2", "approved"), ("update-1", "rejected"), (None, "approved")):
        with pytest.raises(ConflictError, match="already approved"):
            await store.decide_approval(approval_id, decision, "op-1", request_key=key)


def _plain_decision(approval_id: str, decided_by: str = "op-1") -> Decision:
    return Decision(approval_id=approval_id, decision="approved", decided_by=decided_by)


async def _approved_once(store: Any, action: dict[str, Any], answer: Any) -> None:
    """The retry was told the approval stands, and it was recorded once."""
    assert answer.conflict is None, answer.conflict
    assert (answer.approval_status, answer.status) == ("approved", "approved")
    events = [e["event_type"] for e in await store.list_events(action["run_id"])]
    assert events.count("approval.approved") == 1


def _op1_approves(approval_id: str) -> RecordDecisionInput:
    """op-1's approval, attested now, as the workflow sends it (keyed by its
    update)."""
    sent = attest(
        _plain_decision(approval_id), Decider(user_id="op-1", role="operator"), datetime.now(UTC)
    )
    return RecordDecisionInput(decision=sent, request_key="update-1")


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
async def test_a_decision_cancelled_by_its_timeout_is_answered_as_it_stands(store: Any) -> None:
    """Its first attempt cancelled while queued behind a writer, committed
    all the same: Temporal's retry is told the decision stands."""
    action = await _pending(store, "plain-cancel")
    approval_id = action["approval_id"]
    writes = WriteActivities(store, ToolRegistry(), authority=TRUSTING)
    inp = RecordDecisionInput(decision=_plain_decision(approval_id), request_key="update-1")

    await _cancelled_while_queued(store, lambda env: env.run(writes.decide_approval, inp))
    assert (await store.get_approval(approval_id))["status"] == "approved"  # committed
    answer = await ActivityEnvironment().run(writes.decide_approval, inp)  # Temporal's retry
    await _approved_once(store, action, answer)


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
async def test_a_decision_retried_past_the_attestations_age_answers_as_recorded(
    store: Any, action_secret: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A retry after the attestation's ten minutes answers with the
    decision its first attempt recorded; a new request carrying the same
    stale attestation (a first attempt) is still refused."""
    action = await _pending(store, "plain-att")
    approval_id = action["approval_id"]
    writes = WriteActivities(store, ToolRegistry(), authority=TRUSTING)
    keyed = _op1_approves(approval_id)
    first = await ActivityEnvironment().run(writes.decide_approval, keyed)
    _past_the_attestations_age(monkeypatch)
    again = await ActivityEnvironment().run(writes.decide_approval, keyed)
    assert again.conflict is None and again.approval_status == first.approval_status
    with pytest.raises(ApplicationError, match="attestation_expired"):
        fresh_key = keyed.model_copy(update={"request_key": "update-2"})
        await ActivityEnvironment().run(writes.decide_approval, fresh_key)


async def test_an_edit_is_refused_when_its_action_no_longer_waits(store: Any) -> None:
    """A pending approval whose action does not wait for it (no path leads
    there; here by surgery) is never edited nor approved: the arguments of
    a write that may be under way stay as they are, and nothing is
    answered as if the action had moved."""
    from roundtable.store.schema import ActionRow
    from tests.helpers import set_column

    action = await _pending(store, "edit-astray")
    await set_column(store, ActionRow, ActionRow.id == action["id"], status="executing")
    with pytest.raises(ConflictError, match="not waiting for approval"):
        await store.approve_with_edits(
            action["approval_id"],
            "op-1",
            None,
            None,
            {"tenant_id": "tenant-a", "object_id": "elsewhere"},
            Target(key="k-astray", scope=None, namespace_wide=False),
        )
    after = await store.get_action(action["id"])
    assert (after["status"], after["target_key"]) == ("executing", action["target_key"])
    assert after["arguments_digest"] == action["arguments_digest"]
    assert (await store.get_approval(action["approval_id"]))["status"] == "pending"
    events = [e["event_type"] for e in await store.list_events(action["run_id"])]
    assert "action.arguments_edited" not in events and "approval.approved" not in events


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
async def test_a_retry_past_the_age_waits_for_its_first_attempt_still_queued(
    store: Any, action_secret: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The database starved past the attestation's age: the first attempt,
    cancelled by its timeout, still waits in SQLite's writer queue when
    Temporal retries. The retry is not refused as stale ("send it again",
    for a decision about to stand): it queues behind the first attempt and
    is answered with what that attempt recorded (review of 2026-12-07)."""
    action = await _pending(store, "stale-queued")
    approval_id = action["approval_id"]
    writes = WriteActivities(store, ToolRegistry(), authority=TRUSTING)
    keyed = _op1_approves(approval_id)
    queue = store.db._local_writer
    await queue.acquire()
    try:
        env = ActivityEnvironment()
        first = asyncio.create_task(env.run(writes.decide_approval, keyed))
        await _until_queued(queue)
        env.cancel()
        await asyncio.sleep(0.05)
        _past_the_attestations_age(monkeypatch)
        retried = asyncio.create_task(ActivityEnvironment().run(writes.decide_approval, keyed))
        await asyncio.sleep(0.2)
        assert not retried.done()  # queued behind the first attempt, not refused
    finally:
        queue.release()
    with pytest.raises(asyncio.CancelledError):
        await first
    await _approved_once(store, action, await retried)


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
async def test_a_record_answers_only_the_person_it_recorded(
    store: Any, action_secret: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Someone who sends another person's request key (an update id chosen
    through Temporal directly) with a forged attestation is never told the
    other's decision, edit or extension is theirs (review of 2026-12-07)."""
    action = await _pending(store, "forged")
    approval_id = action["approval_id"]
    writes = WriteActivities(store, ToolRegistry(), authority=TRUSTING)
    extension = ExtendInput(
        approval_id=approval_id, seconds=60, extended_by="op-1", request_key="update-2"
    )
    await ActivityEnvironment().run(writes.extend_approval, extension)
    await store.decide_approval(approval_id, "approved", "op-1", None, request_key="update-1")

    def mallorys(attested_at: datetime, forged: bool) -> RecordDecisionInput:
        decision = _plain_decision(approval_id, decided_by="mallory")
        stamped = attest(decision, Decider(user_id="mallory", role="operator"), attested_at)
        if forged:
            mac = stamped.attested_by.model_copy(update={"mac": "0" * 64})
            stamped = stamped.model_copy(update={"attested_by": mac})
        return RecordDecisionInput(decision=stamped, request_key="update-1")

    now = datetime.now(UTC)
    # Fresh but forged (nobody vouched: taken as an unattested decider here).
    answer = await ActivityEnvironment().run(writes.decide_approval, mallorys(now, forged=True))
    assert answer.conflict is not None and "another person" in answer.conflict
    # Too old, forged or genuine: the record is op-1's, so the word stays refused.
    _past_the_attestations_age(monkeypatch)
    for forged in (True, False):
        with pytest.raises(ApplicationError, match="attestation_expired"):
            await ActivityEnvironment().run(writes.decide_approval, mallorys(now, forged))
    with pytest.raises(ConflictError, match="another person"):
        await store.extend_approval(approval_id, 60, "mallory", 3600, request_key="update-2")


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
async def test_a_request_nothing_recorded_is_never_applied_with_an_expired_word(
    store: Any, action_secret: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every attempt of a decision and of an extension failed before
    committing (the database down for hours): a later attempt, its
    attestation long expired, is refused, and changes nothing (second
    review of 2026-12-07: reading the age against the first attempt's
    scheduled time applied them hours late)."""
    action = await _pending(store, "never-recorded")
    approval_id = action["approval_id"]
    before = await store.get_approval(approval_id)
    writes = WriteActivities(store, ToolRegistry(), authority=TRUSTING)
    extension = attest(
        ExtendInput(approval_id=approval_id, seconds=600, extended_by="op-1"),
        Decider(user_id="op-1", role="operator"),
        datetime.now(UTC),
    ).model_copy(update={"request_key": "update-2"})
    decision = _op1_approves(approval_id)
    first_scheduled = datetime.now(UTC)
    _past_the_attestations_age(monkeypatch)
    for run_activity, sent in (
        (writes.extend_approval, extension),
        (writes.decide_approval, decision),
    ):
        # The sixtieth attempt, as Temporal runs it: its first one's schedule.
        env = ActivityEnvironment()
        env.info = dataclasses.replace(env.info, attempt=60, scheduled_time=first_scheduled)
        with pytest.raises(ApplicationError, match="attestation_expired"):
            await env.run(run_activity, sent)
    after = await store.get_approval(approval_id)
    assert (after["status"], after["expires_at"]) == ("pending", before["expires_at"])


def test_an_extension_by_an_update_id_of_any_length_reaches_its_activity() -> None:
    """The workflow keeps an id that is not an attempt's whole (up to
    Temporal's 1,000 characters): its extension's input must still decode on
    the worker (third review of 2026-12-07: a 200-character cap left it
    retrying for ever)."""
    for update_id in ("ops/" + "x" * 250, "y" * 1000):
        sent = ExtendInput(approval_id="a", seconds=60, extended_by="ops").model_copy(
            update={"request_key": update_id}
        )
        assert ExtendInput.model_validate_json(sent.model_dump_json()).request_key == update_id


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
async def test_a_stale_attempt_answers_with_the_runs_status_as_a_fresh_one_does(
    store: Any, action_secret: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Answered from its record past the attestation's age, an attempt that
    carried the run's status tells the run what the store holds, as an
    attempt within the age does (the run otherwise writes it again)."""
    action = await _pending(store, "stale-status")
    status = (await store.get_run(action["run_id"]))["status"]
    writes = WriteActivities(store, ToolRegistry(), authority=TRUSTING)
    keyed = _op1_approves(action["approval_id"]).model_copy(update={"run_status": status})
    first = await ActivityEnvironment().run(writes.decide_approval, keyed)
    _past_the_attestations_age(monkeypatch)
    stale = await ActivityEnvironment().run(writes.decide_approval, keyed)
    assert first.run_status is not None
    assert (stale.conflict, stale.run_status) == (None, first.run_status)
