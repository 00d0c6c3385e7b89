"""Operator actions every interface shares (CLI, HTTP API, typed client).

Decisions and reconciliations go through the run's workflow updates, so all
interfaces and a plain ``temporal workflow update`` meet one truth; Temporal's
refusals come back as the store's typed errors.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import uuid
from collections.abc import Awaitable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from temporalio.client import (
    Client,
    RPCTimeoutOrCancelledError,
    WorkflowFailureError,
    WorkflowUpdateFailedError,
)
from temporalio.common import WorkflowIDReusePolicy
from temporalio.exceptions import ApplicationError, WorkflowAlreadyStartedError
from temporalio.exceptions import TimeoutError as TemporalTimeout
from temporalio.service import RPCError, RPCStatusCode

from roundtable.models import (
    Decision,
    ExtendInput,
    ExtendOutput,
    ReconcileInput,
    ReconcileOutput,
    ReconcileRequest,
    RunInput,
    WorkflowArgs,
)
from roundtable.names import (
    ATTEMPT_MAY_BE_RUNNING,
    DECIDE_UPDATE,
    EXTEND_UPDATE,
    FORBIDDEN_PREFIX,
    INVALID_INPUT,
    NO_TOOL_WORKER,
    NOT_TRACKED,
    RECONCILE_UPDATE,
    RECONCILE_WORKFLOW,
    REFRESH_SIGNAL,
    REQUEST_ATTEMPT_SEPARATOR,
    RUN_WORKFLOW,
)
from roundtable.permissions import Attestable, Authority, Decider, attest
from roundtable.store import (
    FINAL_RUN_STATUSES,
    AttemptMayBeRunningError,
    ConflictError,
    InvalidInputError,
    NotFoundError,
    RunGrant,
    Store,
)
from roundtable.store.decision import change_recorded
from roundtable.store.errors import StoreError, forbidden

FINGERPRINT_MEMO = "request_fingerprint"
RECONCILE_WITHIN = timedelta(minutes=2)
# How much longer than a reconciliation's own deadline its answer is waited
# for: a transaction that judged it in time has committed by then.
LATE_GRACE = timedelta(seconds=5)


class TemporalUnavailableError(RuntimeError):
    code = "temporal_unavailable"


class NoLiveWorkflowError(ConflictError):
    """The run's workflow is closed (or gone): it takes no more messages."""


class NotTrackedError(ConflictError):
    """The run's workflow is open but is not waiting on this action."""


class NoToolWorkerError(ConflictError):
    """No tool worker took the step (worker roles): nothing was done."""


class UnansweredError(TemporalUnavailableError):
    """A reconciliation no worker answered in time (503): whether anything
    was recorded is said in its message."""


class WorkflowStalledError(TemporalUnavailableError):
    """The run's workflow is open but takes no update now: Temporal refuses
    one while its workflow tasks keep failing (a deploy it cannot replay on,
    say) or while it is paused. Nothing was done, and the same request may
    stand once the run is recovered: a 503 of its own code, never the 409
    that says another request decided first."""

    code = "workflow_stalled"


def _typed(exc: WorkflowUpdateFailedError) -> Exception:
    """Bad input stays bad input (422); every other refusal is a conflict (409)."""
    cause = exc.cause
    while cause is not None and not isinstance(cause, ApplicationError):
        cause = cause.cause
    message = str(cause or exc)
    kind = cause.type if isinstance(cause, ApplicationError) else None
    if kind == INVALID_INPUT:
        return InvalidInputError(message)
    if kind and kind.startswith(FORBIDDEN_PREFIX):
        return forbidden(kind.removeprefix(FORBIDDEN_PREFIX), message)
    if kind == NOT_TRACKED:
        return NotTrackedError(message)
    if kind == NO_TOOL_WORKER:
        return NoToolWorkerError(message)
    if kind == ATTEMPT_MAY_BE_RUNNING and cause.details:
        return AttemptMayBeRunningError(
            "", datetime.fromisoformat(str(cause.details[0])), message=message
        )
    return ConflictError(message)


async def send_update(
    client: Client,
    run_id: str,
    update: str,
    payload: Any,
    result_type: type = str,
    update_id: str | None = None,
) -> Any:
    """An update to the run's workflow, its refusals as the store's typed
    errors. ``update_id``: the update's id (default: a fresh one); Temporal
    answers a second update with the id of one it has with that one's
    outcome, and the workflow records the change under the request the id
    names (names.KEYED_ATTEMPT: an attempt's request, else the id itself)."""
    try:
        return await client.get_workflow_handle(run_id).execute_update(
            update, payload, id=update_id, result_type=result_type
        )
    except WorkflowUpdateFailedError as exc:
        raise _typed(exc) from exc
    except RPCError as exc:
        if exc.status == RPCStatusCode.NOT_FOUND:
            raise NoLiveWorkflowError(f"run {run_id} has no live workflow ({exc.message})") from exc
        if exc.status == RPCStatusCode.UNAVAILABLE:
            raise TemporalUnavailableError(f"Temporal is unavailable: {exc.message}") from exc
        if exc.status == RPCStatusCode.FAILED_PRECONDITION:
            raise WorkflowStalledError(
                f"run {run_id}'s workflow takes no requests now ({exc.message}); if its "
                "workflow tasks keep failing, an operator can recover it (roundtable recover), "
                "and this request can be sent again then"
            ) from exc
        raise


async def nudge(client: Client, run_id: str) -> None:
    """Tell the run's workflow (if it is open) that the store changed under it."""
    with contextlib.suppress(RPCError):
        await client.get_workflow_handle(run_id).signal(REFRESH_SIGNAL)


def new_request_id() -> str:
    return uuid.uuid4().hex


async def decide(
    client: Client,
    store: Store,
    approval_id: str,
    decision: str,
    decided_by: str,
    reason: str | None = None,
    arguments_digest: str | None = None,
    arguments: dict[str, Any] | None = None,
    *,
    decider: Decider | None = None,
    idempotency_key: str | None = None,
) -> dict[str, Any]:
    """Decide a pending approval, optionally approving edited ``arguments``.
    ``decider``: who the API or CLI authenticated (role and tenants), attested
    for the worker, which checks separation of duties (permissions.py).
    ``idempotency_key``: the caller's name for this request; sent again
    (its answer lost), it is answered as the first was and decides nothing
    again (:func:`idempotent_request_id`); ``replayed`` in the answer says
    it was answered from the record.
    NotFoundError / ConflictError / InvalidInputError / ForbiddenError."""
    request = None
    if idempotency_key is not None:
        asked = {
            "decision": decision,
            "reason": reason,
            "arguments_digest": arguments_digest,
            "arguments": arguments,
        }
        request = idempotent_request_id("decide", decided_by, approval_id, idempotency_key, asked)
    change = change_recorded(decision, arguments is not None)
    # Checked here as well as by the store under the run lock: a run started
    # before safety-rules-v1 takes any decision the workflow hears as final,
    # even one the store refused, so a stale decision must never reach it.
    approval, action = await store.approval_and_action(approval_id)
    if approval["status"] != "pending":
        kept = await _recorded_request(store, change, approval_id, request, decided_by)
        if kept is None:
            raise ConflictError(f"approval {approval_id} is already {approval['status']}")
        return {**_decision_answer(kept, kept["status"]), "replayed": True}
    if arguments_digest is not None and action["arguments_digest"] != arguments_digest:
        raise ConflictError("arguments_digest does not match the arguments awaiting approval")
    sending = send_update(
        client,
        approval["run_id"],
        DECIDE_UPDATE,
        _attested(
            Decision(
                approval_id=approval_id,
                decision=decision,
                request_id=new_request_id(),
                decided_by=decided_by,
                reason=reason,
                arguments_digest=arguments_digest,
                arguments=arguments,
            ),
            decider,
        ),
        update_id=attempt_of(request),
    )
    status, kept = await _sent_or_recorded(sending, store, change, approval_id, request, decided_by)
    if kept is not None:
        return {**_decision_answer(kept, kept["status"]), "replayed": True}
    return {**_decision_answer(approval, status), "replayed": False}


async def _sent_or_recorded(
    sending: Awaitable[Any],
    store: Store,
    change: str,
    approval_id: str,
    request: str | None,
    actor: str,
) -> tuple[Any, dict[str, Any] | None]:
    """The update's answer, or, when the run refuses it and another attempt
    of ``request`` recorded ``change`` since it was looked for (the run
    then takes the approval as already decided, or the attempt's word as
    too old), that record: the approval as it stands."""
    try:
        return await sending, None
    except StoreError:
        kept = await _recorded_request(store, change, approval_id, request, actor)
        if kept is None:
            raise
        return None, kept


async def _recorded_request(
    store: Store, change: str, approval_id: str, request: str | None, actor: str
) -> dict[str, Any] | None:
    """The approval as it stands, if ``request`` (an idempotent request's
    id) recorded ``change`` on it for ``actor``; None if not, or no
    request (one recorded for another person is not this caller's)."""
    if request is None:
        return None
    kept = await store.keyed_approval_change(change, approval_id, request, actor=actor)
    return kept[0] if kept is not None else None


def attempt_of(request: str | None) -> str | None:
    """The id of one attempt at ``request`` (None: the SDK names it): an
    update of its own, whose refusal is never the answer to the next
    attempt, recorded by the run under the request (names.py)."""
    if request is None:
        return None
    return f"{request}{REQUEST_ATTEMPT_SEPARATOR}{uuid.uuid4().hex}"


def _decision_answer(approval: dict[str, Any], status: str) -> dict[str, Any]:
    return {
        "approval_id": approval["id"],
        "run_id": approval["run_id"],
        "action_id": approval["action_id"],
        "status": status,
    }


def idempotent_request_id(
    kind: str, caller: str, approval_id: str, idempotency_key: str, asked: dict[str, Any]
) -> str:
    """The id of a request made under an Idempotency-Key: the same caller,
    approval, key and request give the same id, so a request sent again (its
    answer lost) is the first one. Each attempt at it is an update of its
    own (:func:`attempt_of`); the run records the change under this id, so
    an attempt that finds it recorded changes nothing and answers with it
    (as does the API, from the audit log, once the approval is decided).
    Another caller's key, or the same key with another request (another
    decision, other edits, another extension), is another request."""
    said = json.dumps(
        {
            "kind": kind,
            "caller": caller,
            "approval_id": approval_id,
            "key": idempotency_key,
            "asked": asked,
        },
        sort_keys=True,
        default=str,
    )
    return f"{kind}-{hashlib.sha256(said.encode()).hexdigest()}"


def _attested(message: Attestable, decider: Decider | None) -> Attestable:
    return message if decider is None else attest(message, decider, datetime.now(UTC))


async def extend(
    client: Client,
    store: Store,
    approval_id: str,
    seconds: int,
    by: str,
    max_seconds: int,
    *,
    max_extensions: int | None = None,
    max_total_seconds: int | None = None,
    decider: Decider | None = None,
    idempotency_key: str | None = None,
) -> dict[str, Any]:
    """Push a pending approval's deadline back through its workflow (the timer
    follows). The store refuses (ConflictError) an extension beyond
    ``max_extensions`` or past ``max_total_seconds`` after the approval was
    created; the worker's own limits apply as well. ``decider``: who extends,
    attested so the worker records them (else as unattested).
    ``idempotency_key``: as for :func:`decide`: sent again, the extension
    is answered as it stands and the deadline moves once."""
    request = None
    if idempotency_key is not None:
        asked = {"seconds": seconds}
        request = idempotent_request_id("extend", by, approval_id, idempotency_key, asked)
    extension = "approval.extended"
    # An extension leaves its approval pending: its record is looked for first.
    kept = await _recorded_request(store, extension, approval_id, request, by)
    if kept is not None:
        return {**_extension_answer(kept), "replayed": True}
    approval = await store.get_approval(approval_id)
    if approval["status"] != "pending":
        raise ConflictError(f"approval {approval_id} is already {approval['status']}")
    if seconds > max_seconds:
        raise InvalidInputError(f"an extension is at most {max_seconds} seconds")
    sending = send_update(
        client,
        approval["run_id"],
        EXTEND_UPDATE,
        _attested(
            ExtendInput(
                approval_id=approval_id,
                seconds=seconds,
                extended_by=by,
                max_seconds=max_seconds,
                max_extensions=max_extensions,
                max_total_seconds=max_total_seconds,
            ),
            decider,
        ),
        ExtendOutput,
        update_id=attempt_of(request),
    )
    extended, kept = await _sent_or_recorded(sending, store, extension, approval_id, request, by)
    if kept is not None:
        return {**_extension_answer(kept), "replayed": True}
    return {**_extension_answer({**approval, "expires_at": extended.expires_at}), "replayed": False}


def _extension_answer(approval: dict[str, Any]) -> dict[str, Any]:
    return {
        "approval_id": approval["id"],
        "run_id": approval["run_id"],
        "expires_at": approval["expires_at"].isoformat(),
    }


async def reconcile(
    client: Client,
    store: Store,
    action_id: str,
    outcome: str,
    decided_by: str,
    note: str | None,
    task_queue: str,
) -> dict[str, Any]:
    """Settle an unknown action, whatever state its run's workflow is in:
    through the workflow when it is open and waiting on the action, directly
    in the store otherwise (same rules, audited), then the workflow, if open,
    is told to look. Refused while the action's attempt may still be running.
    Callers (the API, the CLI) have made sure ``decided_by`` is an operator:
    the workflow's worker takes their word for it only with an attestation."""
    action = await store.get_action(action_id)
    if action["status"] != "unknown":
        if (action["result"] or {}).get("reconciled_outcome"):
            # Settled, perhaps by an earlier call whose nudge was lost: make
            # sure the run has looked, so it does not wait for ever.
            await nudge(client, action["run_id"])
        raise ConflictError(f"action {action_id} is {action['status']}, not unknown")
    # Judged by the database's clock: asked now (a word given while the
    # attempt could still run is never taken), recorded only until not_after,
    # and the answer waited for as long and a little more, so that "not
    # taken" is then the truth.
    asked_at = await store.reconcile_clock()
    request = attest(
        ReconcileInput(
            action_id=action_id,
            outcome=outcome,
            decided_by=decided_by,
            note=note,
            request_id=new_request_id(),
            not_after=asked_at + RECONCILE_WITHIN,
            asked_at=asked_at,
        ),
        Decider(user_id=decided_by, role="operator"),
        datetime.now(UTC),
    )
    # Tool workers elsewhere (worker roles): the one serving the tool fences it.
    published = (await store.published_tools()).get(action["tool_name"])
    tool_queue = published[1] if published and published[1] != task_queue else None
    status, via = await reconcile_request(
        client,
        action["run_id"],
        request,
        task_queue,
        tool_queue,
        store=store,
        answer_within=RECONCILE_WITHIN + LATE_GRACE,
    )
    return {"action_id": action_id, "run_id": action["run_id"], "status": status, "via": via}


async def reconcile_request(
    client: Client,
    run_id: str,
    request: ReconcileInput,
    task_queue: str,
    tool_queue: str | None = None,
    store: Store | None = None,
    answer_within: timedelta | None = None,
) -> tuple[str, str]:
    """``(status, via)``: through the run's workflow when it is open and
    waiting on the action ("workflow"); otherwise through a short
    reconciliation workflow ("store"), so that either way a worker, which
    holds the tools, fences the target before the outcome is written, and
    the run's workflow, if open, is told to look. With ``store``, a path
    that failed after the request may have been recorded (its answer lost
    on the way: a worker gone after the commit, a connection dropped) is
    answered with the request's own record when there is one.
    ``answer_within``: how long the run's workflow is waited for (None: for
    as long as it takes), past the request's ``not_after``: then no worker
    can record it any more, and the caller is told nothing was."""
    deadline = asyncio.timeout(answer_within.total_seconds() if answer_within else None)
    try:
        async with deadline:
            return await send_update(client, run_id, RECONCILE_UPDATE, request), "workflow"
    except (TimeoutError, RPCTimeoutOrCancelledError):
        if not deadline.expired():  # the caller's own cancellation, or an RPC's
            raise
        # The SDK answers the cancellation our deadline makes with an error
        # of its own: either way, no worker answered in time.
        looked, recorded = await _own_record(store, request)
        if recorded is None:
            raise _unanswered(request, looked) from None
        return recorded, "workflow"
    except (NotTrackedError, NoLiveWorkflowError, NoToolWorkerError, WorkflowStalledError):
        # The run's own route may point at a queue nobody serves any more
        # (NoToolWorker): the store path takes the tool's queue as it is now.
        # A stalled run takes no update, and its unknown must not wait for
        # its recovery: the store path needs nothing of the run's workflow.
        pass
    except (StoreError, TemporalUnavailableError, RPCError):
        _, recorded = await _own_record(store, request)
        if recorded is None:
            raise
        return recorded, "workflow"
    failure: Exception | None = None
    try:
        out = await client.execute_workflow(
            RECONCILE_WORKFLOW,
            ReconcileRequest(run_id=run_id, reconcile=request, tool_queue=tool_queue),
            id=f"reconcile-{request.action_id}-{request.request_id}",
            task_queue=task_queue,
            result_type=ReconcileOutput,
            # No worker on the queue: say so rather than wait for ever; and
            # not before the request's not_after (and its grace) has passed.
            execution_timeout=answer_within or RECONCILE_WITHIN,
        )
    except WorkflowFailureError as exc:
        failure = _store_error(exc)
        failure.__cause__ = exc
    except RPCError as exc:
        if exc.status != RPCStatusCode.UNAVAILABLE:
            raise
        failure = TemporalUnavailableError(f"Temporal is unavailable: {exc.message}")
        failure.__cause__ = exc
    if failure is not None:
        looked, recorded = await _own_record(store, request)
        if recorded is not None:
            await nudge(client, run_id)
            return recorded, "store"
        if isinstance(failure, UnansweredError) and answer_within is not None:
            raise _unanswered(request, looked) from failure
        raise failure
    if out.retry_at is not None:
        raise AttemptMayBeRunningError(request.action_id, out.retry_at, message=out.conflict)
    if out.conflict:
        raise ConflictError(out.conflict)
    await nudge(client, run_id)
    return out.status, "store"


def _unanswered(request: ReconcileInput, looked: bool) -> UnansweredError:
    """No worker answered the request by its deadline (past its not_after).
    "Nothing was recorded" only when the request's record was looked for
    under the run lock, behind any worker's transaction still under way,
    and not found: no later transaction can record it any more. Else the
    truth is that it may have been."""
    asked = f"no worker answered the reconciliation of {request.action_id} in time"
    if looked and request.not_after is not None:
        return UnansweredError(
            f"{asked} (is a worker polling the run's task queue?): nothing was recorded, and "
            f"this request can no longer be (it could be until {request.not_after}); "
            "reconcile again once a worker serves the run"
        )
    return UnansweredError(
        f"{asked}, and whether a worker recorded it could not be read now: it may have been, "
        "so look at the action before asking again"
    )


async def _own_record(store: Store | None, request: ReconcileInput) -> tuple[bool, str | None]:
    """``(looked, status)``: the action's status if ``request``'s own
    reconciliation is recorded (store/reconcile_requests.py), read under the
    run lock so that a worker's transaction still under way is waited for;
    ``looked`` False when that could not be read now (no store, the database
    failing): then nothing is known either way. (Not cut short: a store call
    runs to its end, store/__init__.py; the lock waits are the store's.)"""
    if store is None or not request.request_id:
        return False, None
    try:
        mine = await store.reconciled_by_request(
            request.action_id, request.request_id, request.decided_by, request.outcome, locked=True
        )
    except Exception:  # the caller's own failure stands, saying what it knows
        return False, None
    return True, (str(mine["status"]) if mine is not None else None)


def _store_error(exc: WorkflowFailureError) -> Exception:
    """A failed reconciliation workflow as the error its activity raised."""
    cause = exc.cause
    timed_out = False
    while cause is not None and not isinstance(cause, ApplicationError):
        timed_out = timed_out or isinstance(cause, TemporalTimeout)
        cause = cause.cause
    kind = cause.type if isinstance(cause, ApplicationError) else None
    if isinstance(exc.cause, TemporalTimeout):
        # The workflow ran out of time: no worker took it, or one took it
        # late and may be recording it still.
        return UnansweredError(
            "no worker answered the reconciliation in time (is a worker polling this task "
            "queue?): a worker that took it late may still record it, so look at the action "
            "before asking again"
        )
    if timed_out:
        # Its activity started and did not answer (a worker gone, a store
        # that hung): it may have recorded the outcome all the same.
        return TemporalUnavailableError(
            "the reconciliation did not answer in time (its worker gone, or its store "
            "slow): it may still have been recorded, so look at the action before asking again"
        )
    if kind == "NotFound":
        return NotFoundError(str(cause))
    if kind and kind.startswith(FORBIDDEN_PREFIX):
        return forbidden(kind.removeprefix(FORBIDDEN_PREFIX), str(cause))
    return ConflictError(str(cause or exc))


def new_run_id() -> str:
    return f"run-{uuid.uuid4().hex[:16]}"


def request_fingerprint(request: RunInput) -> str:
    return request.fingerprint()


def idempotent_run_id(user_id: str, idempotency_key: str) -> str:
    return "run-" + hashlib.sha256(f"{user_id}\n{idempotency_key}".encode()).hexdigest()[:24]


async def start_run(
    client: Client,
    store: Store,
    request: RunInput,
    task_queue: str,
    *,
    authority: Authority,
    role: str,
    tenants: Sequence[str] | None = None,
) -> tuple[dict[str, Any], bool]:
    """Create the run's rows, then its workflow. Returns ``(run, created)``.
    The same request again (same run id) starts nothing, whatever state its
    workflow is in, even closed; a different request under that id is a
    conflict. A workflow id is never reused for a second execution.

    ``role`` (of whoever asked) caps the write policy; ``tenants`` (None: any)
    bound which tenants the run's writes may name. Both are recorded with the
    run, where the worker checks them again."""
    request = authority.admit(role, request)
    run_id = request.run_id or new_run_id()
    request = request.model_copy(update={"run_id": run_id})
    fingerprint = request_fingerprint(request)
    run = await store.ensure_run(
        run_id=run_id,
        user_id=request.user_id,
        task_text=request.task_text,
        request_fingerprint=fingerprint,
        grant=RunGrant(
            write_policy=request.write_policy,
            role=role,
            tenants=tuple(tenants) if tenants is not None else None,
        ),
    )
    if run["status"] in FINAL_RUN_STATUSES:
        return {"run_id": run_id, "workflow_id": run_id, "status": run["status"]}, False
    try:
        await client.start_workflow(
            RUN_WORKFLOW,
            WorkflowArgs(request=request),
            id=run_id,
            task_queue=task_queue,
            id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
            memo={FINGERPRINT_MEMO: fingerprint},
            static_summary=f"Roundtable: {request.task_text[:100]}",
            static_details=(
                f"seats {', '.join(request.seats)} · {request.max_rounds} round(s) · "
                f"{request.mode} · policy {request.write_policy} · user {request.user_id}"
            ),
        )
        created = True
    except WorkflowAlreadyStartedError:
        await same_request_or_conflict(client, run_id, fingerprint)
        created = False
    except RPCError as exc:
        if exc.status == RPCStatusCode.UNAVAILABLE:
            raise TemporalUnavailableError(f"Temporal is unavailable: {exc.message}") from exc
        raise
    run = await store.get_run(run_id)
    return {"run_id": run_id, "workflow_id": run_id, "status": run["status"]}, created


async def same_request_or_conflict(client: Client, run_id: str, fingerprint: str) -> None:
    described = await client.get_workflow_handle(run_id).describe()
    if await described.memo_value(FINGERPRINT_MEMO, None, type_hint=str) != fingerprint:
        raise ConflictError("this Idempotency-Key was already used for a different request")
