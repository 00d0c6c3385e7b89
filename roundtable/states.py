"""The state machines of docs/architecture.md (section 4) as enums; the store is the only writer."""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from types import MappingProxyType


class ActionStatus(StrEnum):
    WAITING_APPROVAL = "waiting_approval"
    APPROVED = "approved"
    REJECTED = "rejected"
    EXECUTING = "executing"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    UNKNOWN = "unknown"


# Where a new action may start: a write that needs a person waits for one,
# a write the policy lets through starts approved, a write it refuses starts
# rejected (recorded all the same, so every attempt is audited).
INITIAL_ACTION_STATUSES = frozenset(
    {ActionStatus.WAITING_APPROVAL, ActionStatus.APPROVED, ActionStatus.REJECTED}
)
DENIED_BY_POLICY = "denied_by_policy"
FINAL_ACTION_STATUSES = frozenset(
    {ActionStatus.REJECTED, ActionStatus.SUCCEEDED, ActionStatus.FAILED}
)
TERMINAL_RESULT_STATUSES = frozenset(
    {ActionStatus.SUCCEEDED, ActionStatus.FAILED, ActionStatus.UNKNOWN}
)
# Where an action's run of the write path ends: the metrics count moves here.
ENDING_ACTION_STATUSES = FINAL_ACTION_STATUSES | frozenset({ActionStatus.UNKNOWN})
RECONCILE_OUTCOMES = frozenset({ActionStatus.SUCCEEDED, ActionStatus.FAILED})


class ApprovalStatus(StrEnum):
    PENDING = "pending"
    APPROVED = "approved"
    REJECTED = "rejected"
    EXPIRED = "expired"
    # Nobody decided: the run ended first (its action is rejected, run_ended).
    WITHDRAWN = "withdrawn"


APPROVAL_DECISIONS = frozenset({ApprovalStatus.APPROVED, ApprovalStatus.REJECTED})


class RunStatus(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    WAITING_INPUT = "waiting_input"
    # Its workflow cannot make progress (e.g. every workflow task fails on a
    # payload the workers cannot decrypt); the run's failure says why.
    STALLED = "stalled"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    # Its workflow was closed from outside (terminated, timed out, vanished).
    TERMINATED = "terminated"


FINAL_RUN_STATUSES = frozenset(
    {RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED, RunStatus.TERMINATED}
)
_ENDINGS = FINAL_RUN_STATUSES
_LIVE = frozenset({RunStatus.RUNNING, RunStatus.WAITING_INPUT, RunStatus.STALLED})

RUN_TRANSITIONS: Mapping[RunStatus, frozenset[RunStatus]] = MappingProxyType(
    {
        RunStatus.PENDING: _LIVE | _ENDINGS,
        RunStatus.RUNNING: (_LIVE | _ENDINGS) - {RunStatus.RUNNING},
        RunStatus.WAITING_INPUT: (_LIVE | _ENDINGS) - {RunStatus.WAITING_INPUT},
        RunStatus.STALLED: (_LIVE | _ENDINGS) - {RunStatus.STALLED},
        RunStatus.COMPLETED: frozenset(),
        RunStatus.FAILED: frozenset(),
        RunStatus.CANCELLED: frozenset(),
        RunStatus.TERMINATED: frozenset(),
    }
)


class ClaimOutcome(StrEnum):
    """The only answers ``claim_action_for_execution`` gives."""

    CLAIMED = "claimed"
    TARGET_BUSY = "target_busy"
    IN_PROGRESS = "in_progress"
    UNKNOWN = "unknown"
    TARGET_RECONCILIATION_REQUIRED = "target_reconciliation_required"
    NOT_APPROVED = "not_approved"
    ALREADY_FINISHED = "already_finished"


class WriteEnd(StrEnum):
    """How the workflow hears of a write it did not claim itself; beside the
    ClaimOutcomes in ``ExecuteWriteOutput.claim``."""

    WITHDRAWN = "withdrawn"  # the run ended before the write was claimed
    SETTLED = "settled"  # its attempt failed to report: the store says where it stands
    READ = "read"  # no claim was tried: the workflow asked where the write stands


# A call refused before it became an action (no row): PendingWrite.status.
REFUSED = "refused"

LEASE_EXPIRED_ERROR_CODE = "target_lease_expired_during_execution"
WORKFLOW_CLOSED_ERROR_CODE = "workflow_closed_during_execution"
APPROVAL_EXPIRED_REASON = "approval_expired"
RUN_ENDED_REASON = "run_ended"

# A run whose workflow task has failed this many attempts in a row is stalled
# (the sweep says so; recovery asks for at least as much evidence).
STALLED_AFTER_ATTEMPTS = 3
