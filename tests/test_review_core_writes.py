"""Adversarial review of the Core rewrites of the decision (0dc49cf,
roundtable/store/decision.py) and of a write's outcome (49e3f3c,
roundtable/store/outcome.py).

Differential: the old ORM versions (tests/review_core_writes_old.py) and the
new ones run on identical setups, on both databases, over a matrix of inputs;
what each returns or raises, what it tells the metrics, and every row it
leaves (read raw, so JSON null and SQL NULL are told apart) must agree, with
ids, hashes and timestamps normalised. Every chain must verify and every
run's head must equal its last event."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import random
import re
import sqlite3
import threading
import uuid
from collections import Counter
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import pytest
from sqlalchemy import event, null, text
from sqlalchemy.engine import make_url

from roundtable.store import ConflictError, open_store, sqlite_driver
from roundtable.store.commit_notes import ActionEnded, ApprovalSettled
from roundtable.store.schema import ActionRow, ApprovalRow, RunRow
from tests.conftest import _asyncpg_dsn
from tests.helpers import new_action, new_run, set_column, target_for
from tests.review_core_writes_old import old_decide, old_record_result

_TS = re.compile(r"\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(\.\d+)?([+-]\d\d(:\d\d)?)?")
_HASH = re.compile(r"\b[0-9a-f]{64}\b")

# Columns of each table read raw, per run. audit_events.id is left out (a
# sequence shared by all runs of the database).
_TABLES = {
    "sessions": (
        "id, user_id, task_text, status, created_at, updated_at",
        "id = (SELECT session_id FROM runs WHERE id = :run_id)",
        "id",
    ),
    "runs": (
        "id, session_id, user_id, status, last_event_seq, last_event_hash, failure,"
        " created_at, updated_at",
        "id = :run_id",
        "id",
    ),
    "actions": (
        "id, run_id, tool_name, risk_level, status, arguments, arguments_digest, result,"
        " external_object_id, approval_id, attempt_count, target_key, fencing_token,"
        " started_at, finished_at, created_at, updated_at",
        "run_id = :run_id",
        "created_at, idempotency_key",
    ),
    "approvals": (
        "id, action_id, run_id, status, expires_at, decided_by, decision_reason,"
        " decided_at, created_at, updated_at",
        "run_id = :run_id",
        "created_at, expires_at",
    ),
    "action_leases": (
        "target_key, action_id, run_id, fencing_token, acquired_at, lease_expires_at",
        "run_id = :run_id",
        "(SELECT idempotency_key FROM actions WHERE actions.id = action_id)",
    ),
    "audit_events": (
        "run_id, seq, event_type, payload, prev_hash, hash, dedupe_key, created_at",
        "run_id = :run_id",
        "seq",
    ),
}


async def dump(store, run_id: str) -> dict[str, list[tuple]]:
    """Every row of the run, each column as the database holds it (text, or
    None for SQL NULL)."""
    out: dict[str, list[tuple]] = {}
    async with store.db.reader() as session:
        for table, (columns, where, order) in _TABLES.items():
            cols = [c.strip() for c in columns.split(",")]
            select_list = ", ".join(f"CAST({c} AS TEXT)" for c in cols)
            rows = await session.execute(
                text(f"SELECT {select_list} FROM {table} WHERE {where} ORDER BY {order}"),  # noqa: S608 - fixed names
                {"run_id": run_id},
            )
            out[table] = [
                tuple(
                    # runs.failure: JSON null and SQL NULL read alike (None); the
                    # old ORM path left SQL NULL where the new one writes JSON
                    # null (test_leaving_stalled_without_a_failure_writes_json_null).
                    (c, None if (table, c, v) == ("runs", "failure", "null") else v)
                    for c, v in zip(cols, row, strict=True)
                )
                for row in rows
            ]
    return out


def differ(a: Any, b: Any, path: str = "") -> list[str]:
    """Where two normalised results differ, as readable lines."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in sorted(set(a) | set(b), key=str):
            out += differ(a.get(key, "<missing>"), b.get(key, "<missing>"), f"{path}.{key}")
        return out
    if isinstance(a, list | tuple) and isinstance(b, list | tuple) and len(a) == len(b):
        out = []
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            out += differ(x, y, f"{path}[{i}]")
        return out
    return [] if a == b else [f"{path}: old={a!r} new={b!r}"]


def normalise(value: Any, ids: dict[str, str]) -> Any:
    if isinstance(value, dict):
        return {k: normalise(v, ids) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(normalise(v, ids) for v in value)
    if isinstance(value, datetime):
        return "<ts>"
    if isinstance(value, str):
        for real, placeholder in ids.items():
            value = value.replace(real, placeholder)
        value = _TS.sub("<ts>", value)
        return _HASH.sub("<hash>", value)
    return value


def notes(told: list) -> list[tuple]:
    """The notes told, without the (clock-dependent) wait in seconds."""
    return [
        (
            type(n).__name__,
            str(getattr(n, "outcome", "")),
            getattr(n, "tool", ""),
            str(getattr(n, "status", "")),
            getattr(n, "waited_seconds", 0) >= 0,
        )
        for n in told
    ]


async def check_chain(store, run_id: str) -> None:
    assert await store.verify_audit_chain(run_id)
    events = await store.list_events(run_id)
    run = await store.get_run(run_id)
    assert (run["last_event_seq"], run["last_event_hash"]) == (
        events[-1]["seq"],
        events[-1]["hash"],
    )


async def outcome_of(call) -> Any:
    try:
        return ("returned", await call)
    except Exception as exc:  # compared, not swallowed
        return ("raised", type(exc).__name__, str(exc))


# ------------------------------------------------------------------ decisions


async def decision_world(
    store, run_state: str, other: str, overdue: bool
) -> tuple[dict, dict, dict, dict[str, str]]:
    tag = uuid.uuid4().hex[:8]
    run = await new_run(store)
    failure = {"error": "tool worker gone"} if run_state == "stalled" else None
    await set_column(store, RunRow, RunRow.id == run["id"], status=run_state, failure=failure)
    action = await new_action(
        store, run, key=f"a-{tag}", target_key=target_for(f"a-{tag}"), status="waiting_approval"
    )
    approval = await store.create_approval(
        action_id=action["id"], expires_at=datetime.now(UTC) + timedelta(minutes=5)
    )
    ids = {
        run["session_id"]: "<session>",
        run["id"]: "<run>",
        action["id"]: "<action>",
        approval["id"]: "<approval>",
        f"a-{tag}": "<key-a>",
        target_for(f"a-{tag}"): "<target-a>",
    }
    if other == "pending":
        other_action = await new_action(
            store, run, key=f"b-{tag}", target_key=target_for(f"b-{tag}"), status="waiting_approval"
        )
        other_approval = await store.create_approval(
            action_id=other_action["id"], expires_at=datetime.now(UTC) + timedelta(minutes=9)
        )
        ids.update({other_action["id"]: "<action-b>", other_approval["id"]: "<approval-b>"})
    elif other == "unknown":
        other_action = await new_action(
            store, run, key=f"b-{tag}", target_key=target_for(f"b-{tag}"), status="approved"
        )
        await set_column(store, ActionRow, ActionRow.id == other_action["id"], status="unknown")
        ids[other_action["id"]] = "<action-b>"
    if other != "none":
        ids.update({f"b-{tag}": "<key-b>", target_for(f"b-{tag}"): "<target-b>"})
    if overdue:
        await set_column(
            store,
            ApprovalRow,
            ApprovalRow.id == approval["id"],
            expires_at=datetime.now(UTC) - timedelta(seconds=1),
        )
    return run, action, approval, ids


# The matrices' short form: `make test` takes a fixed half of each (a seeded
# sample, so no dimension is left at one value); `make stress` takes every
# case (REVIEW_MATRIX=all). Both halves are the same on every run.
WHOLE_MATRICES = os.environ.get("REVIEW_MATRIX") == "all"


def _short(cases: list) -> list:
    if WHOLE_MATRICES:
        return cases
    return random.Random(20261203).sample(cases, len(cases) // 2)  # noqa: S311 - not a secret


DECISION_MATRIX = list(
    itertools.product(
        ["approved", "rejected"],
        [None, "running", "waiting_input", "completed"],
        ["waiting_input", "running", "stalled", "cancelled"],
        ["none", "pending", "unknown"],
        [False, True],
    )
)


async def test_old_and_new_decisions_leave_the_same_rows(store) -> None:
    """The matrix above, old and new on twin setups: same answer, same notes,
    same rows."""
    told: list = []
    store.db.observers.append(told.extend)
    differences = []
    for decision, run_status, run_state, other, overdue in _short(DECISION_MATRIX):
        seen = []
        for implementation in (old_decide, _new_decide):
            run, _, approval, ids = await decision_world(store, run_state, other, overdue)
            told.clear()
            answer = await outcome_of(
                implementation(
                    store, approval["id"], decision, "op-1", "why", run_status=run_status
                )
            )
            await check_chain(store, run["id"])
            seen.append(normalise((answer, notes(told), await dump(store, run["id"])), ids))
        if seen[0] != seen[1]:
            differences.append(((decision, run_status, run_state, other, overdue), differ(*seen)))
    assert not differences, "\n".join(f"{case}: {lines}" for case, lines in differences)


def _new_decide(store, approval_id, decision, decided_by, reason=None, **kwargs):
    return store.decide_approval(approval_id, decision, decided_by, reason, **kwargs)


def _refusing_guard(owner: str, risk: str) -> None:
    raise PermissionError(f"{owner} may not decide {risk}")


def _allowing_guard(owner: str, risk: str) -> None:
    assert (owner, risk) == ("u1", "R3")


REFUSALS = {
    "guard-refuses": {"guard": _refusing_guard},
    "guard-allows": {"guard": _allowing_guard},
    "digest-wrong": {"arguments_digest": "sha256:not-it"},
    "digest-empty": {"arguments_digest": ""},
    "nul-decider": {"decided_by": "op\x00"},
    "nul-reason": {"reason": "no\x00"},
    "blank-decider": {"decided_by": "  "},
    "bad-decision": {"decision": "maybe"},
    "bad-run-status": {"run_status": "sideways"},
    "missing": {"approval_id": "no-such-approval"},
    "nul-id": {"approval_id": "x\x00"},
    "already-decided": {},
    "overdue-and-refused-guard": {"guard": _refusing_guard},
    "overdue-and-digest-wrong": {"arguments_digest": "sha256:not-it"},
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
async def test_old_and_new_refusals_agree(store, case: str) -> None:
    told: list = []
    store.db.observers.append(told.extend)
    seen = []
    for implementation in (old_decide, _new_decide):
        run, _, approval, ids = await decision_world(
            store, "waiting_input", "none", case.startswith("overdue")
        )
        if case == "already-decided":
            await store.decide_approval(approval["id"], "rejected", "op-0")
        told.clear()
        kwargs = dict(REFUSALS[case])
        call = {
            "approval_id": kwargs.pop("approval_id", approval["id"]),
            "decision": kwargs.pop("decision", "approved"),
            "decided_by": kwargs.pop("decided_by", "op-1"),
            "reason": kwargs.pop("reason", "why"),
        }
        kwargs.setdefault("run_status", "running")
        answer = await outcome_of(
            implementation(
                store,
                call["approval_id"],
                call["decision"],
                call["decided_by"],
                call["reason"],
                **kwargs,
            )
        )
        await check_chain(store, run["id"])
        seen.append(normalise((answer, notes(told), await dump(store, run["id"])), ids))
    assert not differ(*seen), differ(*seen)


# ------------------------------------------------------------------- outcomes


async def outcome_world(store, prior: str) -> tuple[dict, dict, int | None, dict[str, str]]:
    tag = uuid.uuid4().hex[:8]
    run = await new_run(store)
    action = await new_action(store, run, key=f"a-{tag}", target_key=target_for(f"a-{tag}"))
    token = None
    if prior != "approved":
        claim = await store.claim_for_execution(action["id"], 30)
        token = claim.action["fencing_token"]
    if prior == "unknown":
        await store.recover_expired_action_leases(
            run_id=run["id"], now=datetime.now(UTC) + timedelta(hours=1)
        )
    if prior == "succeeded":
        assert await store.record_action_terminal_result(
            action["id"], "succeeded", {"ok": True}, fencing_token=token
        )
    ids = {
        run["session_id"]: "<session>",
        run["id"]: "<run>",
        action["id"]: "<action>",
        f"a-{tag}": "<key-a>",
        target_for(f"a-{tag}"): "<target-a>",
    }
    return run, action, token, ids


RESULTS = {
    "none": (None, None),
    "nul": ({"error_code": "e\x00x", "k\x00": ["\ud800", {"n": None}], "d": 1.5}, "T-\x00-\udc80"),
    "plain": ({"error_code": 7, "detail": "x"}, "T-1"),
}

OUTCOME_MATRIX = list(
    itertools.product(
        ["succeeded", "failed", "unknown"],
        [False, True],
        ["right", "wrong", "none"],
        ["executing", "unknown", "succeeded", "approved"],
        sorted(RESULTS),
    )
)


async def test_old_and_new_outcomes_leave_the_same_rows(store) -> None:
    told: list = []
    store.db.observers.append(told.extend)
    differences = []
    for status, attempt_over, token_kind, prior, result_kind in _short(OUTCOME_MATRIX):
        seen = []
        for implementation in (old_record_result, _new_record):
            run, action, token, ids = await outcome_world(store, prior)
            told.clear()
            result, external = RESULTS[result_kind]
            fencing = {"right": token, "wrong": (token or 0) + 1, "none": None}[token_kind]
            answer = await outcome_of(
                implementation(
                    store,
                    action["id"],
                    status,
                    result,
                    fencing_token=fencing,
                    external_object_id=external,
                    attempt_over=attempt_over,
                )
            )
            await check_chain(store, run["id"])
            seen.append(normalise((answer, notes(told), await dump(store, run["id"])), ids))
        if seen[0] != seen[1]:
            differences.append(
                ((status, attempt_over, token_kind, prior, result_kind), differ(*seen))
            )
    assert not differences, "\n".join(f"{case}: {lines}" for case, lines in differences)


def _new_record(store, action_id, status, result=None, **kwargs):
    return store.record_action_terminal_result(action_id, status, result, **kwargs)


# ---------------------------------------------------------------- concurrency


async def _race_round(stores: list, rng: random.Random) -> None:
    """One run with approvals and executing writes; every write path that
    touches them, at once, through ``stores`` (one engine each: on SQLite two
    stores are two writers as two processes would be)."""
    store = stores[0]
    told: list = []
    for s in stores:
        s.db.observers.append(told.extend)
    run = await new_run(store)
    await set_column(store, RunRow, RunRow.id == run["id"], status="waiting_input")
    tag = uuid.uuid4().hex[:8]
    approvals, executing = [], []
    for i in range(3):
        action = await new_action(
            store,
            run,
            key=f"w{i}-{tag}",
            target_key=target_for(f"w{i}-{tag}"),
            status="waiting_approval",
        )
        approval = await store.create_approval(
            action_id=action["id"], expires_at=datetime.now(UTC) + timedelta(minutes=5)
        )
        approvals.append(approval)
    for i in range(3):
        action = await new_action(
            store, run, key=f"x{i}-{tag}", target_key=target_for(f"x{i}-{tag}")
        )
        claim = await store.claim_for_execution(action["id"], 30)
        executing.append((action, claim.action["fencing_token"]))

    calls: list[tuple[str, str, Any]] = []
    for approval in approvals:
        aid = approval["id"]
        calls += [
            (
                "decide",
                aid,
                lambda s, a=aid: s.decide_approval(a, "approved", "op-a", run_status="running"),
            ),
            (
                "decide",
                aid,
                lambda s, a=aid: s.decide_approval(a, "rejected", "op-b", run_status="running"),
            ),
            ("expire", aid, lambda s, a=aid: s.expire_approval(a)),
            ("extend", aid, lambda s, a=aid: s.extend_approval(a, 60, "op-c", 3600)),
        ]
    for action, token in executing:
        xid = action["id"]
        calls += [
            (
                "record",
                xid,
                lambda s, x=xid, t=token: s.record_action_terminal_result(
                    x, "succeeded", {"ok": 1}, fencing_token=t, attempt_over=True
                ),
            ),
            (
                "record",
                xid,
                lambda s, x=xid, t=token: s.record_action_terminal_result(
                    x, "failed", {"error_code": "boom"}, fencing_token=t
                ),
            ),
            (
                "record",
                xid,
                lambda s, x=xid, t=token: s.record_action_terminal_result(
                    x, "unknown", {"error_code": "lost"}, fencing_token=t, attempt_over=True
                ),
            ),
        ]
    calls.append(
        (
            "recover",
            run["id"],
            lambda s: s.recover_expired_action_leases(
                run_id=run["id"], now=datetime.now(UTC) + timedelta(hours=1)
            ),
        )
    )
    calls.append(
        (
            "sweep",
            run["id"],
            lambda s: s.expire_due_approvals(
                run_id=run["id"], now=datetime.now(UTC) + timedelta(hours=1)
            ),
        )
    )
    rng.shuffle(calls)
    answers = await asyncio.gather(
        *(fn(stores[i % len(stores)]) for i, (_, _, fn) in enumerate(calls)),
        return_exceptions=True,
    )
    for answer in answers:
        if isinstance(answer, Exception):
            assert type(answer).__name__ in {"ConflictError"}, repr(answer)

    await check_chain(store, run["id"])
    events = await store.list_events(run["id"])
    for approval in approvals:
        stored = await store.get_approval(approval["id"])
        settled = [
            e
            for e in events
            if e["event_type"] in {"approval.approved", "approval.rejected", "approval.expired"}
            and e["payload"].get("approval_id") == approval["id"]
        ]
        assert len(settled) == 1, settled
        assert settled[0]["event_type"] == f"approval.{stored['status']}"
        won = [
            a
            for (kind, target, _), a in zip(calls, answers, strict=True)
            if kind == "decide" and target == approval["id"] and isinstance(a, dict)
        ]
        assert len(won) <= 1
        if won:
            assert won[0]["status"] == stored["status"]
        action = await store.get_action(stored["action_id"])
        assert action["status"] == ("approved" if stored["status"] == "approved" else "rejected")
    for action, _token in executing:
        stored = await store.get_action(action["id"])
        ended = [
            e
            for e in events
            if e["event_type"] in {"action.succeeded", "action.failed", "action.unknown"}
            and e["payload"].get("action_id") == action["id"]
        ]
        assert len(ended) == 1, ended
        assert ended[0]["event_type"] == f"action.{stored['status']}"
        won = [
            a
            for (kind, target, _), a in zip(calls, answers, strict=True)
            if kind == "record" and target == action["id"] and a is True
        ]
        assert len(won) <= 1
        lease = await _lease_row(store, action["id"])
        assert (lease is None) == (stored["status"] != "unknown"), (stored["status"], lease)
    # Metrics: one settlement per approval, one ending per ended action.
    kinds = Counter(type(n).__name__ for n in told)
    assert kinds[ApprovalSettled.__name__] == len(approvals)
    statuses = [(await store.get_approval(a["id"]))["status"] for a in approvals]
    ended_actions = len(approvals) - statuses.count("approved") + len(executing)
    assert kinds[ActionEnded.__name__] == ended_actions, told
    if (await store.get_run(run["id"]))["status"] == "running":
        assert "pending" not in statuses


async def _lease_row(store, action_id: str):
    async with store.db.reader() as session:
        return (
            await session.execute(
                text("SELECT fencing_token FROM action_leases WHERE action_id = :a"),
                {"a": action_id},
            )
        ).one_or_none()


ROUNDS = int(os.environ.get("REVIEW_ROUNDS", "8"))


async def test_everything_at_once_on_one_run(database_url: str) -> None:
    """Decisions by two deciders, expiry, extension, the sweep, three
    outcomes per write and lease recovery, all at once on one run; on SQLite
    through two engines (two writers, as two processes). Decided once,
    recorded once, the chain unbroken, the metrics told once per change."""
    rng = random.Random(1234)  # noqa: S311 - a fixed order, not a secret
    async with open_store(database_url) as first, open_store(database_url, migrate=False) as second:
        for _ in range(ROUNDS):
            await _race_round([first, second], rng)


# ------------------------------------------------ failures between statements


class _Injected(Exception):
    pass


@contextlib.contextmanager
def fail_after(store, count: int, exc: BaseException):
    """Raise ``exc`` once the ``count``-th statement (of any transaction) has
    run on the database: the transaction is cut between two statements."""
    seen = {"n": 0}

    def after(*_args: Any) -> None:
        seen["n"] += 1
        if seen["n"] == count:
            raise exc

    event.listen(store.engine.sync_engine, "after_cursor_execute", after)
    try:
        yield seen
    finally:
        event.remove(store.engine.sync_engine, "after_cursor_execute", after)


def _write_lock_is_free(database_url: str) -> bool:
    """SQLite only: another process could take the write lock right now."""
    path = make_url(database_url).database
    connection = sqlite3.connect(path, timeout=0, isolation_level=None)
    try:
        connection.execute("BEGIN IMMEDIATE")
        connection.execute("ROLLBACK")
        return True
    except sqlite3.OperationalError:
        return False
    finally:
        connection.close()


@pytest.mark.parametrize("exc", [asyncio.CancelledError, _Injected])
async def test_a_decision_cut_between_statements_leaves_nothing(
    store, database_url: str, exc: type[BaseException]
) -> None:
    """Cut after each of the decision's statements in turn (the run moved to
    running: eight): nothing is written, nothing told, the write lock is
    free, and the next decision on a pooled connection goes through."""
    told: list = []
    store.db.observers.append(told.extend)
    for cut in range(1, 9):
        run, _, approval, _ = await decision_world(store, "waiting_input", "none", False)
        before = await dump(store, run["id"])
        told.clear()
        with fail_after(store, cut, exc()), pytest.raises(exc):
            await store.decide_approval(approval["id"], "approved", "op-1", run_status="running")
        assert await dump(store, run["id"]) == before, cut
        assert told == []
        if store.engine.dialect.name == "sqlite":
            assert _write_lock_is_free(database_url)
        decided = await store.decide_approval(
            approval["id"], "approved", "op-1", run_status="running"
        )
        assert decided["status"] == "approved" and decided["run_status"] == "running"
        await check_chain(store, run["id"])


@pytest.mark.parametrize("exc", [asyncio.CancelledError, _Injected])
async def test_an_outcome_cut_between_statements_leaves_nothing(
    store, database_url: str, exc: type[BaseException]
) -> None:
    told: list = []
    store.db.observers.append(told.extend)
    for cut in range(1, 7):
        run, action, token, _ = await outcome_world(store, "executing")
        before = await dump(store, run["id"])
        told.clear()
        with fail_after(store, cut, exc()), pytest.raises(exc):
            await store.record_action_terminal_result(
                action["id"], "succeeded", {"ok": 1}, fencing_token=token
            )
        assert await dump(store, run["id"]) == before, cut
        assert told == []
        if store.engine.dialect.name == "sqlite":
            assert _write_lock_is_free(database_url)
        assert await store.record_action_terminal_result(
            action["id"], "succeeded", {"ok": 1}, fencing_token=token
        )
        assert await _lease_row(store, action["id"]) is None
        await check_chain(store, run["id"])


# ------------------------------------------ what a writer waiting for the lock sees


class _Holder:
    """Another process holding the run's lock (SQLite: the write lock; PostgreSQL:
    the run's row lock), changing rows under it, then committing once the
    store's writer is seen waiting for it."""

    def __init__(self, database_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
        self.url = database_url
        self.sqlite = database_url.startswith("sqlite")
        self.monkeypatch = monkeypatch
        self.waiting = threading.Event()

    async def __aenter__(self) -> _Holder:
        if self.sqlite:
            self.raw = sqlite3.connect(make_url(self.url).database, isolation_level=None)
            self.raw.execute("BEGIN IMMEDIATE")
            original = sqlite_driver.OneTripConnection._open
            waiting = self.waiting

            def open_(connection, begin):  # on the driver's thread
                waiting.set()  # about to wait for the write lock
                return original(connection, begin)

            self.monkeypatch.setattr(sqlite_driver.OneTripConnection, "_open", open_)
        else:
            self.raw = await asyncpg.connect(_asyncpg_dsn(self.url))
            self.admin = await asyncpg.connect(_asyncpg_dsn(self.url))
            self.transaction = self.raw.transaction()
            await self.transaction.start()
        return self

    async def lock_run(self, run_id: str) -> None:
        if not self.sqlite:
            await self.raw.execute("SELECT id FROM runs WHERE id = $1 FOR UPDATE", run_id)

    async def execute(self, sql: str, *args: Any) -> None:
        if self.sqlite:
            self.raw.execute(sql.replace("$1", "?").replace("$2", "?"), args)
        else:
            await self.raw.execute(sql, *args)

    async def commit_once_waited_for(self) -> None:
        if self.sqlite:
            await asyncio.to_thread(self.waiting.wait)
            self.raw.execute("COMMIT")
            return
        # Polled, not timed: the writer is seen queued on the lock.
        while not await self.admin.fetchval(  # noqa: ASYNC110
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE wait_event_type = 'Lock' AND datname = current_database()"
        ):
            await asyncio.sleep(0.01)
        await self.transaction.commit()

    async def __aexit__(self, *_exc: object) -> None:
        if self.sqlite:
            self.raw.close()
        else:
            await self.raw.close()
            await self.admin.close()


SQL_PAST = {
    "sqlite": "UPDATE approvals SET expires_at = '2000-01-01 00:00:00.000000' WHERE id = $1",
    "postgresql": "UPDATE approvals SET expires_at = '2000-01-01T00:00:00Z' WHERE id = $1",
}


@pytest.mark.parametrize("change", ["overdue", "decided", "edited"])
async def test_a_decision_waiting_for_the_lock_judges_what_the_holder_committed(
    store, database_url: str, monkeypatch: pytest.MonkeyPatch, change: str
) -> None:
    """The decision's facts are read after the lock it waited for: a deadline
    moved into the past, a decision or an edit committed by the holder is
    what it judges (never a snapshot from before its wait)."""
    run, action, approval, _ = await decision_world(store, "waiting_input", "none", False)
    digest = "sha256:shown"
    await set_column(store, ActionRow, ActionRow.id == action["id"], arguments_digest=digest)
    async with _Holder(database_url, monkeypatch) as holder:
        await holder.lock_run(run["id"])
        if change == "overdue":
            await holder.execute(SQL_PAST[store.engine.dialect.name], approval["id"])
        elif change == "decided":
            await holder.execute(
                "UPDATE approvals SET status = 'rejected' WHERE id = $1", approval["id"]
            )
        else:
            await holder.execute(
                "UPDATE actions SET arguments_digest = 'sha256:edited' WHERE id = $1", action["id"]
            )
        deciding = asyncio.ensure_future(
            store.decide_approval(
                approval["id"], "approved", "op-1", arguments_digest=digest, run_status="running"
            )
        )
        await holder.commit_once_waited_for()
        with pytest.raises(ConflictError) as refused:
            await deciding
    expected = {
        "overdue": "expired before the decision",
        "decided": "already rejected",
        "edited": "arguments_digest does not match",
    }[change]
    assert expected in str(refused.value)
    stored = await store.get_approval(approval["id"])
    assert stored["status"] == (
        "expired" if change == "overdue" else "rejected" if change == "decided" else "pending"
    )
    await check_chain(store, run["id"])


@pytest.mark.parametrize("change", ["unknown", "retoken", "finished"])
async def test_an_outcome_waiting_for_the_lock_judges_what_the_holder_committed(
    store, database_url: str, monkeypatch: pytest.MonkeyPatch, change: str
) -> None:
    run, action, token, _ = await outcome_world(store, "executing")
    async with _Holder(database_url, monkeypatch) as holder:
        await holder.lock_run(run["id"])
        if change == "unknown":
            await holder.execute(
                "UPDATE actions SET status = 'unknown' WHERE id = $1", action["id"]
            )
        elif change == "retoken":
            await holder.execute(
                "UPDATE actions SET fencing_token = fencing_token + 1 WHERE id = $1", action["id"]
            )
        else:
            await holder.execute("UPDATE actions SET status = 'failed' WHERE id = $1", action["id"])
        recording = asyncio.ensure_future(
            store.record_action_terminal_result(
                action["id"], "succeeded", {"ok": 1}, fencing_token=token, attempt_over=True
            )
        )
        await holder.commit_once_waited_for()
        assert await recording is False
    stored = await store.get_action(action["id"])
    assert (
        stored["status"]
        == {"unknown": "unknown", "retoken": "executing", "finished": "failed"}[change]
    )
    assert await _lease_row(store, action["id"]) is not None  # nothing freed
    events = await store.list_events(run["id"])
    assert "action.succeeded" not in [e["event_type"] for e in events]
    await check_chain(store, run["id"])


async def test_sqlite_reads_the_decisions_clock_only_once_it_holds_the_write_lock(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SQLite's clock is this process's: read before the wait for another
    process's write lock, it would be stale by the wait. The holder keeps the
    lock while the clock reads 'before the deadline' and lets go once it reads
    'after'; the decision must see 'after' and expire."""
    # SQLite only: PostgreSQL's clock is clock_timestamp(), read in the
    # statement after the lock (tested by the lock-wait tests above).
    database_url = f"sqlite+aiosqlite:///{tmp_path / 'roundtable.db'}"
    async with open_store(database_url) as store:
        import roundtable.store.core_writes as decision_module  # where the clock is read

        _, _, approval, _ = await decision_world(store, "waiting_input", "none", False)
        deadline = (await store.get_approval(approval["id"]))["expires_at"]
        clock = {"now": deadline - timedelta(seconds=30)}

        class FakeDatetime(datetime):
            @classmethod
            def now(cls, tz=None):
                return clock["now"]

        monkeypatch.setattr(decision_module, "datetime", FakeDatetime)
        async with _Holder(database_url, monkeypatch) as holder:
            deciding = asyncio.ensure_future(
                store.decide_approval(approval["id"], "approved", "op-1")
            )
            await asyncio.to_thread(holder.waiting.wait)
            clock["now"] = deadline + timedelta(seconds=1)
            holder.raw.execute("COMMIT")
            with pytest.raises(ConflictError, match="expired before the decision"):
                await deciding
        assert (await store.get_approval(approval["id"]))["status"] == "expired"


# ------------------------------------------------- sequences, old and new twins


async def twin_world(store, tag: str) -> tuple[dict, list, list, dict[str, str]]:
    run = await new_run(store)
    await set_column(store, RunRow, RunRow.id == run["id"], status="waiting_input")
    ids = {run["session_id"]: "<session>", run["id"]: "<run>"}
    approvals, actions = [], []
    for i in range(2):
        key = f"w{i}-{tag}"
        action = await new_action(
            store, run, key=key, target_key=target_for(key), status="waiting_approval"
        )
        approval = await store.create_approval(
            action_id=action["id"], expires_at=datetime.now(UTC) + timedelta(minutes=5)
        )
        approvals.append(approval)
        actions.append(action)
        ids.update({action["id"]: f"<w{i}>", approval["id"]: f"<ap{i}>", key: f"<kw{i}>"})
        ids[target_for(key)] = f"<tw{i}>"
    for i in range(2):
        key = f"x{i}-{tag}"
        action = await new_action(store, run, key=key, target_key=target_for(key))
        actions.append(action)
        ids.update({action["id"]: f"<x{i}>", key: f"<kx{i}>", target_for(key): f"<tx{i}>"})
    return run, approvals, actions, ids


def _step(rng: random.Random) -> tuple:
    kind = rng.choice(
        [
            "decide",
            "decide",
            "extend",
            "expire",
            "overdue",
            "claim",
            "claim",
            "record",
            "record",
            "record",
            "recover",
            "reconcile",
            "withdraw",
            "run",
        ]
    )
    return (
        kind,
        rng.randrange(2),
        rng.randrange(4),
        rng.choice(["approved", "rejected"]),
        rng.choice([None, "running", "waiting_input", "stalled", "completed"]),
        rng.choice(["succeeded", "failed", "unknown"]),
        rng.choice(["right", "right", "wrong", "none"]),
        rng.choice([False, True]),
        rng.choice(sorted(RESULTS)),
    )


async def _apply(store, world, step, old: bool) -> Any:
    run, approvals, actions, _ = world
    kind, i, j, decision, run_status, status, token_kind, over, result_kind = step
    approval_id, action_id = approvals[i]["id"], actions[j]["id"]
    if kind == "decide":
        decide = old_decide if old else _new_decide
        return await outcome_of(
            decide(store, approval_id, decision, "op-1", "r", run_status=run_status)
        )
    if kind == "extend":
        return await outcome_of(store.extend_approval(approval_id, 60, "op-2", 3600))
    if kind == "expire":
        return await outcome_of(store.expire_approval(approval_id))
    if kind == "overdue":
        await set_column(
            store,
            ApprovalRow,
            ApprovalRow.id == approval_id,
            expires_at=datetime.now(UTC) - timedelta(seconds=1),
        )
        return None
    if kind == "claim":
        claim = await outcome_of(store.claim_for_execution(action_id, 30))
        return claim[0], getattr(claim[1], "outcome", claim[1:])
    if kind == "record":
        current = (await store.get_action(action_id))["fencing_token"]
        token = {"right": current, "wrong": (current or 0) + 7, "none": None}[token_kind]
        result, external = RESULTS[result_kind]
        record = old_record_result if old else _new_record
        return await outcome_of(
            record(
                store,
                action_id,
                status,
                result,
                fencing_token=token,
                external_object_id=external,
                attempt_over=over,
            )
        )
    if kind == "recover":
        return await outcome_of(
            store.recover_expired_action_leases(
                run_id=run["id"], now=datetime.now(UTC) + timedelta(hours=1)
            )
        )
    if kind == "reconcile":
        return await outcome_of(
            store.reconcile_action(action_id, status if status != "unknown" else "failed", "op-3")
        )
    if kind == "withdraw":
        return await outcome_of(store.withdraw_action(action_id, "run_ended"))
    live = run_status if run_status in {"running", "waiting_input", "stalled"} else "running"
    await set_column(
        store,
        RunRow,
        RunRow.id == run["id"],
        status=live,
        failure={"e": "x"} if live == "stalled" else None,
    )
    return None


SEQUENCES = int(os.environ.get("REVIEW_SEQUENCES", "12"))


async def test_old_and_new_agree_over_random_sequences(store) -> None:
    """Twin runs take the same random steps (decisions, extensions, expiries,
    claims, outcomes, recovery, reconciliation, withdrawal, run moves); the
    twin deciding and recording through the old ORM code and the one through
    the new Core code must agree after every step."""
    told: list = []
    store.db.observers.append(told.extend)
    rng = random.Random(20261202)  # noqa: S311 - a fixed order, not a secret
    for sequence in range(SEQUENCES):
        tag = uuid.uuid4().hex[:8]
        worlds = [await twin_world(store, f"o{tag}"), await twin_world(store, f"n{tag}")]
        for number in range(14):
            step = _step(rng)
            seen = []
            for world, old in zip(worlds, (True, False), strict=True):
                told.clear()
                answer = await _apply(store, world, step, old)
                await check_chain(store, world[0]["id"])
                seen.append(
                    normalise((answer, notes(told), await dump(store, world[0]["id"])), world[3])
                )
            assert not differ(*seen), (sequence, number, step, differ(*seen))


async def test_leaving_stalled_without_a_failure_leaves_it_sql_null(store) -> None:
    """A run stalled without a failure and moved on by a decision keeps SQL
    NULL in runs.failure, as through the old ORM path (the attribute did not
    change, so it was not written). Found by the review: decision.py wrote
    JSON null there; it now writes the failure only when one is stored."""
    raw = []
    for decide in (old_decide, _new_decide):
        run, _, approval, _ = await decision_world(store, "stalled", "none", False)
        await set_column(store, RunRow, RunRow.id == run["id"], failure=null())
        await decide(store, approval["id"], "rejected", "op-1", run_status="completed")
        assert (await store.get_run(run["id"]))["failure"] is None
        async with store.db.reader() as session:
            raw.append(
                (
                    await session.execute(
                        text("SELECT CAST(failure AS TEXT) FROM runs WHERE id = :r"),
                        {"r": run["id"]},
                    )
                ).scalar_one()
            )
    assert raw == [None, None]


# ------------------------------- SQLite and PostgreSQL disagree (pre-existing)


async def test_a_long_external_object_id_does_not_lose_the_writes_outcome(store) -> None:
    """Found by the review (pre-existing: the old ORM path did the same): the
    column is String(255), and on PostgreSQL a longer id (a tool's output,
    unbounded) made the UPDATE fail, so the succeeded write was not recorded
    and later turned unknown; SQLite recorded it. Now cut, with a digest of
    the whole, on both (outcome.storable_external_id)."""
    _, action, token, _ = await outcome_world(store, "executing")
    recorded = await outcome_of(
        store.record_action_terminal_result(
            action["id"],
            "succeeded",
            {"ok": 1},
            fencing_token=token,
            external_object_id="T-" + "9" * 300,
            attempt_over=True,
        )
    )
    assert recorded == ("returned", True), recorded
    stored = await store.get_action(action["id"])
    assert stored["status"] == "succeeded"
    assert len(stored["external_object_id"]) == 255
    assert stored["external_object_id"].startswith("T-999")


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
async def test_a_non_finite_number_in_a_result_does_not_lose_the_writes_outcome(
    store, value: float
) -> None:
    """Found by the review (pre-existing, both paths): a tool's result with
    NaN or Infinity (Python's json writes them; PostgreSQL's jsonb refuses
    them) was recorded on SQLite and refused on PostgreSQL, where the
    succeeded write turned unknown. Now kept as strings on both
    (store/text.py)."""
    _, action, token, _ = await outcome_world(store, "executing")
    recorded = await outcome_of(
        store.record_action_terminal_result(
            action["id"], "succeeded", {"rate": value}, fencing_token=token, attempt_over=True
        )
    )
    assert recorded == ("returned", True), recorded
    stored = await store.get_action(action["id"])
    assert stored["status"] == "succeeded"
    assert stored["result"] == {
        "rate": {"nan": "NaN", "inf": "Infinity"}.get(str(value), "-Infinity")
    }


async def test_an_edit_of_a_large_number_keeps_the_chain_verifiable(store) -> None:
    """Found by the review (pre-existing, outside the two rewritten paths):
    an event's hash covers its payload as json.dumps writes it; jsonb kept
    1e16 as numeric and gave it back as 10000000000000000 (an int), so the
    recomputed hash differed and verify_chain failed for the run from that
    event on. Reached by approving with edits a safe numeric field. Such a
    float is now written as the integer it is (store/text.py)."""
    from roundtable.security import derive_target
    from tests.helpers import WRITE_TOOL, snapshot

    run = await new_run(store)
    arguments = {"tenant_id": "tenant-a", "object_id": "task-1", "amount": 1.5}
    action = await new_action(
        store,
        run,
        key=f"e-{uuid.uuid4().hex[:8]}",
        target_key=target_for("task-1"),
        status="waiting_approval",
        arguments=arguments,
        safe_argument_fields=["tenant_id", "object_id", "amount"],
        approval_expires_at=datetime.now(UTC) + timedelta(minutes=5),
    )
    edited = {**arguments, "amount": 1e16}
    target = derive_target(WRITE_TOOL, edited, snapshot(), "seat-1")
    _, changes = await store.approve_with_edits(
        action["approval_id"], "op-1", None, action["arguments_digest"], edited, target
    )
    assert changes == [{"field": "amount", "before": 1.5, "after": 1e16}]
    assert await store.verify_audit_chain(run["id"])


async def test_a_cancelled_caller_leaves_a_whole_decision_or_none(store, database_url: str) -> None:
    """The caller's task cancelled after 0, 1, 2, ... turns of the event loop:
    the decision is whole or absent (never half), the write lock is free,
    and the next decision on the same pool goes through."""
    for turns in range(0, 40, 2):
        run, _, approval, _ = await decision_world(store, "waiting_input", "none", False)
        task = asyncio.ensure_future(
            store.decide_approval(approval["id"], "approved", "op-1", run_status="running")
        )
        for _ in range(turns):
            await asyncio.sleep(0)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await check_chain(store, run["id"])
        stored = await store.get_approval(approval["id"])
        events = [e["event_type"] for e in await store.list_events(run["id"])]
        if stored["status"] == "pending":
            assert "approval.approved" not in events
            await store.decide_approval(approval["id"], "approved", "op-1", run_status="running")
        else:
            assert stored["status"] == "approved"
            assert events[-3:] == ["approval.approved", "action.approved", "run.status_changed"]
        if store.engine.dialect.name == "sqlite":
            assert _write_lock_is_free(database_url)
        assert (await store.get_run(run["id"]))["status"] == "running"


async def test_the_decision_runs_at_read_committed_whatever_the_database_default(
    postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PostgreSQL whose default isolation is REPEATABLE READ (a DBA's choice):
    the decision still reads, after the run lock it waited for, what the
    holder committed (its transaction is pinned to READ COMMITTED, as the
    claim's is), instead of failing on a serialization error or judging a
    snapshot from before its wait."""
    admin = await asyncpg.connect(_asyncpg_dsn(postgres_url))
    try:
        name = make_url(postgres_url).database
        await admin.execute(
            f"ALTER DATABASE \"{name}\" SET default_transaction_isolation = 'repeatable read'"
        )
    finally:
        await admin.close()
    async with open_store(postgres_url) as store:
        run, _, approval, _ = await decision_world(store, "waiting_input", "none", False)
        async with _Holder(postgres_url, monkeypatch) as holder:
            assert await holder.raw.fetchval("SHOW transaction_isolation") == "repeatable read"
            await holder.lock_run(run["id"])
            await holder.execute(SQL_PAST["postgresql"], approval["id"])
            deciding = asyncio.ensure_future(
                store.decide_approval(approval["id"], "approved", "op-1", run_status="running")
            )
            await holder.commit_once_waited_for()
            with pytest.raises(ConflictError, match="expired before the decision"):
                await deciding
        assert (await store.get_approval(approval["id"]))["status"] == "expired"
        await check_chain(store, run["id"])
