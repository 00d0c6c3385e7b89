"""The promise, checked after the fact: over the ticket system's write log, the
store's runs, actions, approvals and audit events, and what Temporal says of
each run, find every place where it was broken.

Pure functions over plain rows (:class:`Evidence`), so each rule can be fed a
hand-made broken history in a unit test; :mod:`roundtable.evidence` gathers
the rows from the real parts. Rules, numbered as in the chaos issue:

1. each action's write reached the ticket system at most once (per idempotency key:
   one log entry, and that entry's call arrived once, even where the ticket
   system's own idempotency absorbed a repeat);
2. applied writes to one ticket never overlap in time, their fencing tokens grow
   in the order they started, and no scope accepted one token twice;
3. every action of a finished run is final or ``unknown``; nothing is left
   ``executing`` without a live lease;
4. the store and the ticket log agree: every ``succeeded`` write is in the log
   as applied, and every applied write belongs to a ``succeeded`` or ``unknown``
   action;
5. every approval was decided, expired or withdrawn exactly once, and its
   action agrees;
6. every run's audit chain verifies, and each action's state has its event;
7. every run is final, or waiting with a reason; none was lost; the store and
   Temporal agree about which runs are closed.
"""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from roundtable.states import FINAL_RUN_STATUSES

FINAL_ACTIONS = frozenset({"succeeded", "failed", "rejected", "unknown"})
DECIDED_APPROVALS = frozenset({"approved", "rejected", "expired", "withdrawn"})
# What an approval's ending leaves its action in (or anything past it).
_AFTER_APPROVAL = {
    "approved": frozenset({"approved", "executing", "succeeded", "failed", "unknown"}),
    "rejected": frozenset({"rejected"}),
    "expired": frozenset({"rejected"}),
    "withdrawn": frozenset({"rejected"}),
    "pending": frozenset({"waiting_approval"}),
}
# The audit events that may have brought an action to each status.
_EVENTS_OF = {
    "waiting_approval": frozenset({"action.created"}),
    "approved": frozenset({"action.created", "action.approved"}),
    "rejected": frozenset({"action.created", "action.rejected"}),
    "executing": frozenset({"action.executing"}),
    "succeeded": frozenset({"action.succeeded", "action.reconciled"}),
    "failed": frozenset({"action.failed", "action.reconciled"}),
    "unknown": frozenset({"action.unknown"}),
}


@dataclass(frozen=True)
class Violation:
    rule: int
    subject: str  # the run, action, approval, ticket or key it is about
    message: str

    def __str__(self) -> str:
        return f"rule {self.rule} · {self.subject}: {self.message}"


@dataclass
class Evidence:
    """Everything the rules read, as plain dicts (store rows and log rows)."""

    runs: list[dict[str, Any]]
    actions: list[dict[str, Any]]
    approvals: list[dict[str, Any]]
    events: Mapping[str, list[dict[str, Any]]]  # run id → its audit events
    chains_ok: Mapping[str, bool]  # run id → its hash chain verifies
    ticket_writes: list[dict[str, Any]]
    live_leases: set[str] = field(default_factory=set)  # action ids holding a lease now
    # Run ids the workload started (None: not known), and what Temporal says
    # of each workflow: closed or not (None: not asked).
    started_runs: set[str] | None = None
    closed_in_temporal: Mapping[str, bool] | None = None
    # Which tools write to the ticket system (others' writes are not in its log).
    ticket_tools: frozenset[str] = frozenset({"ticket_comment", "ticket_update", "ticket_close"})


def check(evidence: Evidence) -> list[Violation]:
    """Every violation of every rule, in rule order."""
    rules = (
        _at_most_once,
        _no_overlaps,
        _actions_end,
        _store_agrees_with_the_log,
        _approvals_end_once,
        _audit_holds,
        _runs_accounted_for,
    )
    return [violation for rule in rules for violation in rule(evidence)]


def summary(evidence: Evidence, violations: list[Violation], faults: int = 0) -> str:
    return (
        f"runs={len(evidence.runs)} actions={len(evidence.actions)} "
        f"faults={faults} violations={len(violations)}"
    )


# ----------------------------------------------------------------- rule 1


def _at_most_once(ev: Evidence) -> Iterator[Violation]:
    reached = Counter(
        w["idempotency_key"] for w in ev.ticket_writes if w["outcome"] != "rejected_stale"
    )
    for key, count in sorted(reached.items()):
        if count > 1:
            yield Violation(1, key, f"reached the ticket system {count} times")
    for write in ev.ticket_writes:
        arrivals = write.get("arrivals", 1)
        if arrivals > 1:
            yield Violation(
                1, write["idempotency_key"], f"was sent to the ticket system {arrivals} times"
            )
    per_key = Counter(a["idempotency_key"] for a in ev.actions)
    for key, count in sorted(per_key.items()):
        if count > 1:
            yield Violation(1, key, f"{count} actions share one idempotency key")


# ----------------------------------------------------------------- rule 2


def _no_overlaps(ev: Evidence) -> Iterator[Violation]:
    applied = [w for w in ev.ticket_writes if w["outcome"] == "applied"]
    by_ticket: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for write in applied:
        by_ticket[(write["tenant_id"], write["ticket_id"])].append(write)
    for (tenant, ticket), writes in sorted(by_ticket.items()):
        writes.sort(key=lambda w: (w["started_at"], w["fencing_token"]))
        subject = f"{tenant}/{ticket}"
        longest: dict[str, Any] | None = None  # of the writes so far, the one ending last
        for before, after in itertools.pairwise(writes):
            longest = before if longest is None or _ends_later(before, longest) else longest
            if _overlap(longest, after):
                yield Violation(
                    2,
                    subject,
                    f"writes {longest['idempotency_key']} and {after['idempotency_key']} "
                    "overlapped in time",
                )
            if after["fencing_token"] <= before["fencing_token"]:
                yield Violation(
                    2,
                    subject,
                    f"fencing token went from {before['fencing_token']} to "
                    f"{after['fencing_token']}",
                )
    scopes = {a["idempotency_key"]: a.get("target_scope") for a in ev.actions}
    accepted: dict[str, Counter[int]] = defaultdict(Counter)
    for write in applied:
        scope = scopes.get(write["idempotency_key"]) or f"{write['tenant_id']}/?"
        accepted[scope][write["fencing_token"]] += 1
    for scope, tokens in sorted(accepted.items()):
        for token, count in sorted(tokens.items()):
            if count > 1:
                yield Violation(2, scope, f"fencing token {token} was accepted {count} times")


def _ends_later(first: Mapping[str, Any], second: Mapping[str, Any]) -> bool:
    if second.get("finished_at") is None:
        return False
    return first.get("finished_at") is None or first["finished_at"] > second["finished_at"]


def _overlap(first: Mapping[str, Any], second: Mapping[str, Any]) -> bool:
    end: datetime | None = first.get("finished_at")
    return end is None or second["started_at"] < end


# ----------------------------------------------------------------- rule 3


def _actions_end(ev: Evidence) -> Iterator[Violation]:
    final_runs = {r["id"] for r in ev.runs if r["status"] in FINAL_RUN_STATUSES}
    for action in ev.actions:
        status, subject = action["status"], action["id"]
        if status == "executing" and subject not in ev.live_leases:
            yield Violation(3, subject, "executing without a live lease")
        elif action["run_id"] in final_runs and status not in FINAL_ACTIONS:
            yield Violation(3, subject, f"left {status} in a finished run")


# ----------------------------------------------------------------- rule 4


def _store_agrees_with_the_log(ev: Evidence) -> Iterator[Violation]:
    writes = {w["idempotency_key"]: w for w in ev.ticket_writes}
    actions = {a["idempotency_key"]: a for a in ev.actions}
    for action in ev.actions:
        if action["tool_name"] not in ev.ticket_tools or action["status"] != "succeeded":
            continue
        write = writes.get(action["idempotency_key"])
        if write is None or write["outcome"] != "applied":
            seen = "no write" if write is None else f"a write {write['outcome']}"
            yield Violation(4, action["id"], f"succeeded, but the ticket log shows {seen}")
    for key, write in sorted(writes.items()):
        if write["outcome"] != "applied":
            continue
        action = actions.get(key)
        if action is None:
            yield Violation(4, key, "an applied write no action made")
        elif action["status"] not in ("succeeded", "unknown"):
            yield Violation(
                4, action["id"], f"the ticket shows the write applied, the store {action['status']}"
            )


# ----------------------------------------------------------------- rule 5


def _approvals_end_once(ev: Evidence) -> Iterator[Violation]:
    actions = {a["id"]: a for a in ev.actions}
    endings: Counter[str] = Counter()
    for events in ev.events.values():
        for event in events:
            kind = event["event_type"]
            if kind.startswith("approval.") and kind.split(".", 1)[1] in DECIDED_APPROVALS:
                endings[(event.get("payload") or {}).get("approval_id", "?")] += 1
    final_runs = {r["id"] for r in ev.runs if r["status"] in FINAL_RUN_STATUSES}
    for approval in ev.approvals:
        status, subject = approval["status"], approval["id"]
        ended = endings.get(subject, 0)
        if status in DECIDED_APPROVALS and ended != 1:
            yield Violation(5, subject, f"{status}, with {ended} ending events")
        if status == "pending" and (ended or approval["run_id"] in final_runs):
            yield Violation(5, subject, "still pending after its run or its decision ended")
        action = actions.get(approval["action_id"])
        if action is not None and action["status"] not in _AFTER_APPROVAL.get(status, ()):
            yield Violation(
                5, subject, f"the approval is {status} but its action is {action['status']}"
            )


# ----------------------------------------------------------------- rule 6


def _audit_holds(ev: Evidence) -> Iterator[Violation]:
    for run in ev.runs:
        if not ev.chains_ok.get(run["id"], False):
            yield Violation(6, run["id"], "the audit hash chain does not verify")
    said: dict[str, set[str]] = defaultdict(set)
    for events in ev.events.values():
        for event in events:
            action_id = (event.get("payload") or {}).get("action_id")
            if action_id:
                said[action_id].add(event["event_type"])
    for action in ev.actions:
        wanted = _EVENTS_OF[action["status"]]
        if not wanted & said.get(action["id"], set()):
            yield Violation(6, action["id"], f"{action['status']} without any of {sorted(wanted)}")


# ----------------------------------------------------------------- rule 7


def _runs_accounted_for(ev: Evidence) -> Iterator[Violation]:
    known = {r["id"] for r in ev.runs}
    for run_id in sorted((ev.started_runs or set()) - known):
        yield Violation(7, run_id, "started, but the store has no such run")
    waiting_on = _waits(ev.actions, ev.approvals)
    for run in ev.runs:
        status, subject = run["status"], run["id"]
        if status == "waiting_input" and not (run.get("failure") or waiting_on.get(subject)):
            yield Violation(7, subject, "waiting_input with nothing to wait for")
        elif status not in FINAL_RUN_STATUSES and status != "waiting_input":
            yield Violation(7, subject, f"{status} after the workload went quiet")
        if ev.closed_in_temporal is not None and subject in ev.closed_in_temporal:
            closed = ev.closed_in_temporal[subject]
            if closed != (status in FINAL_RUN_STATUSES):
                where = "closed" if closed else "open"
                yield Violation(7, subject, f"{status} in the store, {where} in Temporal")


def _waits(actions: Iterable[dict[str, Any]], approvals: Iterable[dict[str, Any]]) -> dict:
    reasons: dict[str, list[str]] = defaultdict(list)
    for action in actions:
        if action["status"] == "unknown" and not (action.get("result") or {}).get(
            "reconciled_outcome"
        ):
            reasons[action["run_id"]].append(f"unknown {action['id']}")
    for approval in approvals:
        if approval["status"] == "pending":
            reasons[approval["run_id"]].append(f"approval {approval['id']}")
    return reasons
