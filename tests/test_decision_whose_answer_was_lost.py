"""What a decision is told when its call on a tool worker failed with no
answer (the worker died, or none took it): ``WriteActivities.request_decision``,
on both databases (the run's side in tests/test_worker_roles_failures.py).

The run used to ask the store for the approval's status alone, and answered
the caller with it whenever it was the decision they had asked for: a
decision another person, or another request of theirs, had recorded in the
meantime was told to them as their own. Now only the request's own record
(its key, its person) is its answer; anything else that ended the approval
is a conflict, named for what it is. The approval's edits are returned
whoever made them: the write goes out with them, so its seat is told.
(Review of 521197c, 2026-12-07: the forged word, the expired wording.)
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from temporalio.testing import ActivityEnvironment

from activities.write_activities import WriteActivities
from roundtable.models import Decision, DecisionRecorded, RecordDecisionInput
from roundtable.permissions import Decider, attest
from roundtable.security import Target
from roundtable.tools.registry import ToolRegistry
from tests.helpers import new_run, waiting_action
from tests.test_decisions_answered_from_their_commit import approve_edited, seat_was_told_of_edits
from tests.test_operator_changes_applied_once import _pending, _plain_decision
from tests.workflow_harness import TRUSTING, harness, script, ticket_call
from worker import build_worker

REQUEST = "update-of-op-1"
EDITED = {"tenant_id": "tenant-a", "object_id": "edited"}


async def _asked(
    store: Any, decision: Decision, request_key: str | None = REQUEST
) -> DecisionRecorded:
    """What the run is told of ``decision``, sent as ``request_key``."""
    writes = WriteActivities(store, ToolRegistry(), authority=TRUSTING)
    sent = RecordDecisionInput(decision=decision, request_key=request_key, run_status="running")
    return await ActivityEnvironment().run(writes.request_decision, sent)


async def _edit(store: Any, approval_id: str, by: str, request_key: str | None) -> None:
    target = Target(key="k-edited", scope=None, namespace_wide=False)
    await store.approve_with_edits(
        approval_id, by, None, None, EDITED, target, request_key=request_key
    )


def _edited_fields(told: DecisionRecorded) -> set[str]:
    """The fields the edits told of (their values are redacted: the test
    action marks none safe to show)."""
    return {change["field"] for change in told.edits or []}


def _edited(approval_id: str) -> Decision:
    return _plain_decision(approval_id).model_copy(update={"arguments": EDITED})


async def test_its_own_record_is_its_answer(store: Any) -> None:
    action = await _pending(store, "lost-own")
    await store.decide_approval(action["approval_id"], "approved", "op-1", request_key=REQUEST)
    told = await _asked(store, _plain_decision(action["approval_id"]))
    assert told.conflict is None, told.conflict
    assert (told.approval_status, told.status, told.run_status) == (
        "approved",
        "approved",
        (await store.get_run(action["run_id"]))["status"],
    )


async def test_its_own_edit_is_its_answer_with_the_edits(store: Any) -> None:
    action = await _pending(store, "lost-own-edit")
    await _edit(store, action["approval_id"], "op-1", REQUEST)
    told = await _asked(store, _edited(action["approval_id"]))
    assert told.conflict is None, told.conflict
    assert told.approval_status == "approved"
    assert _edited_fields(told) == {"object_id", "tenant_id"}, told.edits


async def test_a_pending_approval_is_no_answer(store: Any) -> None:
    action = await _pending(store, "lost-pending")
    told = await _asked(store, _plain_decision(action["approval_id"]))
    assert (told.approval_status, told.conflict, told.edits) == ("pending", None, None)


@pytest.mark.parametrize(
    ("by", "request_key", "decision"),
    [
        ("op-2", None, "approved"),  # another person, by a signal
        ("op-2", "update-of-op-2", "approved"),  # another person's request
        ("op-2", REQUEST, "approved"),  # another person under this request's id
        ("op-1", "another-update-of-op-1", "approved"),  # the same person, another request
        ("op-2", "update-of-op-2", "rejected"),
    ],
)
async def test_a_decision_recorded_by_anything_else_is_a_conflict(
    store: Any, by: str, request_key: str | None, decision: str
) -> None:
    action = await _pending(store, f"lost-other-{by}-{request_key}-{decision}")
    await store.decide_approval(action["approval_id"], decision, by, request_key=request_key)
    told = await _asked(store, _plain_decision(action["approval_id"]))
    assert told.conflict == f"{decision} by another request or person", told.conflict
    assert told.approval_status == decision


async def test_edits_anyone_made_are_returned_with_the_conflict(store: Any) -> None:
    """op-2 approved with edits; op-1's plain approval failed: op-1 is told
    of a conflict, and the seat of the edits its write goes out with."""
    action = await _pending(store, "lost-edited-by-op-2")
    await _edit(store, action["approval_id"], "op-2", "update-of-op-2")
    told = await _asked(store, _plain_decision(action["approval_id"]))
    assert told.conflict == "approved by another request or person"
    assert _edited_fields(told) == {"object_id", "tenant_id"}, told.edits


async def test_an_edit_asked_is_not_answered_by_a_plain_approval(store: Any) -> None:
    """op-1 asked for edits; the record under their request is a plain
    approval (another decision than the one asked): a conflict, no edits."""
    action = await _pending(store, "lost-edit-vs-plain")
    await store.decide_approval(action["approval_id"], "approved", "op-1", request_key=REQUEST)
    told = await _asked(store, _edited(action["approval_id"]))
    assert (told.conflict, told.edits) == ("approved by another request or person", None)


async def test_an_expired_approval_is_said_to_be_expired(store: Any) -> None:
    action = await _pending(store, "lost-expired")
    assert await store.expire_approval(action["approval_id"])
    told = await _asked(store, _plain_decision(action["approval_id"]))
    assert told.conflict == "expired", told.conflict


async def test_a_signal_is_never_told_a_decision_is_its_own(store: Any) -> None:
    """A signal has no request id: whose decision stands cannot be told, and
    it is not said to be another's either."""
    action = await _pending(store, "lost-signal")
    await store.decide_approval(action["approval_id"], "approved", "op-1")
    told = await _asked(store, _plain_decision(action["approval_id"]), request_key=None)
    assert told.conflict is not None and "cannot be told" in told.conflict, told.conflict


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
async def test_a_word_whose_mac_fails_answers_no_record(store: Any, action_secret: str) -> None:
    """A message claiming op-1 with a forged attestation, under op-1's
    request id, is not told op-1's decision is its own (the workflow does
    not even ask after the tool worker's own refusal; this is the
    activity's part), nor that it is another's: a genuine word this worker
    cannot verify (its action secret rotated last) is the same to it."""
    action = await _pending(store, "lost-forged")
    approval_id = action["approval_id"]
    await store.decide_approval(approval_id, "approved", "op-1", request_key=REQUEST)
    stamped = attest(
        _plain_decision(approval_id), Decider(user_id="op-1", role="operator"), datetime.now(UTC)
    )
    assert stamped.attested_by is not None
    forged = stamped.model_copy(
        update={"attested_by": stamped.attested_by.model_copy(update={"mac": "0" * 64})}
    )
    said = (await _asked(store, forged)).conflict
    assert said == "approved: this request's attestation does not verify on this worker", said
    assert (await _asked(store, stamped)).conflict is None  # the real word is answered


# ------------------------------------------------ edits whose answer came late


# The late-edits run's workflow task timeout: while a local activity runs,
# its workflow task stays open, and new events reach the run only at the
# task's heartbeat (80% of this); shorter than Temporal's 10 s so the test
# waits less for it.
TASK_TIMEOUT = timedelta(seconds=4)


class _AnswersAfterTheWrite:
    """The worker's store: an edited approval commits, and its answer comes
    back only once the write has gone out (an answer delayed, a retry after
    a lost one): the run learnt the approval was decided some other way."""

    def __init__(self, store: Any) -> None:
        self._store = store

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    async def approve_with_edits(self, approval_id: str, *args: Any, **kwargs: Any) -> Any:
        answer = await self._store.approve_with_edits(approval_id, *args, **kwargs)
        action_id = (await self._store.get_approval(approval_id))["action_id"]
        for _ in range(600):
            if (await self._store.get_action(action_id))["status"] == "succeeded":
                # Until the write's outcome has reached the run: past the
                # workflow task's heartbeat (TASK_TIMEOUT).
                await asyncio.sleep(TASK_TIMEOUT.total_seconds() + 1)
                return answer
            await asyncio.sleep(0.1)
        raise AssertionError("the write never went out")


def _answering_late(client: Any, queue: str, store: Any, registry: Any, **options: Any) -> Any:
    return build_worker(client, queue, _AnswersAfterTheWrite(store), registry, **options)


@pytest.mark.timeout(120)
async def test_edits_reach_the_seat_when_the_decisions_answer_comes_after_the_write(
    tmp_path: Any,
) -> None:
    """The run learns the approval is decided from its deadline's timer (the
    expiry finds it approved) while the edited decision's answer is still on
    its way; the write goes out with the edits. The seat used to be told of
    edits only by that answer, and was told nothing: it read its own
    arguments as written (the third review of 2026-12-06, low finding 5)."""
    calls = [ticket_call("ticket_update", "T-1", fields={"priority": "low"})]
    async with harness(tmp_path, worker_factory=_answering_late, dev_server=True) as h:
        handle = await h.start(
            task_text="t",
            script=script(("seat-1", 1, calls)),
            approval_timeout_seconds=3,
            task_timeout=TASK_TIMEOUT,
        )
        state = await h.wait_for(handle, lambda s: bool(s.pending_approvals))
        (approval_id,) = state.pending_approvals
        assert await approve_edited(handle, approval_id) == "approved"
        assert (await h.result(handle)).status == "completed"
        (write,) = await h.tickets.write_log()
        assert write["ticket_id"] == "T-2"  # the edits went out
        await seat_was_told_of_edits(h, handle)


async def test_another_approvals_edits_of_the_run_are_not_this_ones(store: Any) -> None:
    """The edits told are this approval's own, not those of another write of
    the same run."""
    run = await new_run(store)
    deadline = datetime.now(UTC) + timedelta(hours=1)
    edited = await waiting_action(store, run, "lost-two-edited", deadline)
    plain = await waiting_action(store, run, "lost-two-plain", deadline)
    await _edit(store, edited["approval_id"], "op-2", "update-of-op-2")
    await store.decide_approval(plain["approval_id"], "approved", "op-1", request_key=REQUEST)
    told = await _asked(store, _plain_decision(plain["approval_id"]))
    assert (told.conflict, told.edits) == (None, None)
    told = await _asked(store, _plain_decision(edited["approval_id"]))
    assert _edited_fields(told) == {"object_id", "tenant_id"}


async def test_an_edit_no_request_names_is_found_too(store: Any) -> None:
    """A signal's edit has no request key; its event still has a dedupe key
    of the approval's own, by which its edits are found."""
    action = await _pending(store, "lost-unkeyed-edit")
    await _edit(store, action["approval_id"], "op-2", None)
    told = await _asked(store, _plain_decision(action["approval_id"]))
    assert _edited_fields(told) == {"object_id", "tenant_id"}
