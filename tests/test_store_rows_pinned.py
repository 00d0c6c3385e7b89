"""What the store answers and stores when a run opens and a write is
intercepted, pinned: recorded from the ORM implementation the Core
statements replaced (6354f25, f1c1edd), compared on every run since. Ids,
times, hashes and sealed text are normalised; everything else (each column of
each row as the database holds it, each answer, each refusal's message)
must stay as recorded. A deliberate change rewrites the files:

    ROUNDTABLE_REPIN=1 .venv/bin/pytest tests/test_store_rows_pinned.py
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from roundtable.store import Store
from roundtable.store.runs import RunGrant

GOLDEN = Path(__file__).parent / "golden"
STUCK = {"code": "s", "message": "m"}
_MASKS = (
    (r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", "<uuid>"),
    (r"\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(\.\d+)?(\+00:00)?", "<time>"),
    (r'"[0-9a-f]{64}"', '"<hash>"'),
    (r'"(hmac-sha256|sha256):[0-9a-f]+"', '"<digest>"'),
    (r'"enc:v1:[^"]+"', '"<sealed>"'),
)


def _normalised(value: Any) -> Any:
    dumped = json.dumps(value, default=str, sort_keys=True)
    for pattern, mask in _MASKS:
        dumped = re.sub(pattern, mask, dumped)
    return json.loads(dumped)


async def _answers(calls: list[tuple[str, Callable[[], Awaitable[Any]]]]) -> dict[str, Any]:
    got: dict[str, Any] = {}
    for name, call in calls:
        try:
            got[name] = await call()
        except Exception as exc:  # the refusal is part of what is pinned
            got[name] = f"{type(exc).__name__}: {exc}"
    return got


async def _rows(store: Store, tables: dict[str, str]) -> dict[str, Any]:
    rows = {}
    async with store.db.engine.connect() as connection:
        for table, order in tables.items():
            result = await connection.execute(text(f"SELECT * FROM {table} ORDER BY {order}"))  # noqa: S608
            rows[table] = [dict(row._mapping) for row in result]
    return rows


async def _opening(store: Store) -> dict[str, Any]:
    def ensure(run_id: str, user_id: str = "u", task_text: Any = "t", **more: Any) -> Any:
        return lambda: store.ensure_run(run_id=run_id, user_id=user_id, task_text=task_text, **more)

    got = await _answers(
        [
            ("ensure_new", ensure("r1", task_text="task é ✓ x", request_fingerprint="f" * 64)),
            ("ensure_again", ensure("r1", task_text="other")),
            ("ensure_other_user", ensure("r1", user_id="v")),
            ("ensure_other_fp", ensure("r1", request_fingerprint="e" * 64)),
            ("ensure_bad_user", ensure("r9", user_id=" ")),
            ("ensure_bad_text", ensure("r9", task_text=5)),
            ("ensure_lone_surrogate", ensure("r8", task_text="a\ud800b")),
            ("ensure_nul", ensure("r7", task_text="a\x00b")),
            (
                "ensure_grant",
                ensure(
                    "r2",
                    grant=RunGrant(
                        write_policy="auto_approve_up_to:R1", role="operator", tenants=("acme",)
                    ),
                ),
            ),
            ("pin1", lambda: store.pin_snapshot("r1", "a" * 64, status="running", body="{}")),
            ("pin_same", lambda: store.pin_snapshot("r1", "a" * 64, status="running", body="{}")),
            ("pin_other", lambda: store.pin_snapshot("r1", "b" * 64, status="waiting_input")),
            ("pin_no_status", lambda: store.pin_snapshot("r2", "b" * 64)),
            ("set_status", lambda: store.set_run_status("r2", "running")),
            (
                "set_status_failed",
                lambda: store.set_run_status("r2", "failed", failure={"code": "x", "message": "y"}),
            ),
            ("set_status_refused", lambda: store.set_run_status("r2", "running")),
            ("pin_after_end", lambda: store.pin_snapshot("r2", "c" * 64, status="running")),
            ("pin_missing", lambda: store.pin_snapshot("nope", "c" * 64, status="running")),
            ("ensure_r3", ensure("r3")),
            (
                "stalled",
                lambda: store.set_run_status("r3", "stalled", failure=STUCK),
            ),
            ("pin_unstalls", lambda: store.pin_snapshot("r3", "a" * 64, status="running")),
            ("kept", lambda: store.kept_snapshot("a" * 64)),
            ("kept_missing", lambda: store.kept_snapshot("f" * 64)),
        ]
    )
    tables = {
        "sessions": "created_at, task_text",
        "runs": "id",
        "audit_events": "run_id, seq",
        "capability_snapshots": "digest",
    }
    return {**got, "raw": await _rows(store, tables)}


async def _intercepts(store: Store) -> dict[str, Any]:
    run = await store.ensure_run(run_id="r1", user_id="u", task_text="t")
    await store.pin_snapshot("r1", "a" * 64, status="running")
    later = datetime.now(UTC) + timedelta(hours=1)

    def write(key: str, run_status: str | None = None, **more: Any) -> Any:
        fields = {
            "session_id": run["session_id"],
            "run_id": run["id"],
            "agent_id": "seat-1",
            "tool_name": "ticket_comment",
            "idempotency_key": key,
            "target_key": f"demo:{key}",
            "risk_level": "R1",
            "status": "approved",
            **more,
        }
        return lambda: store.create_action(fields, run_status=run_status)

    first = {
        "arguments": {"ticket_id": "T-1", "body": "secret é"},
        "safe_argument_fields": ["ticket_id"],
        "logical_action_id": "L1",
        "turn_index": 3,
    }
    waiting = {"status": "waiting_approval", "approval_expires_at": later}
    got = await _answers(
        [
            ("approved_args", write("k1", **first)),
            ("approved_noargs", write("k2")),
            ("repeat_same", write("k1", **first)),
            ("repeat_other", write("k1", tool_name="other")),
            ("rejected", write("k3", status="rejected", arguments={"a": 1})),
            (
                "waiting",
                write("k4", "waiting_input", **waiting, risk_level="R3", arguments={"x": "y"}),
            ),
            ("waiting_no_status", write("k5", **waiting)),
            (
                "waiting_past",
                write("k6", **{**waiting, "approval_expires_at": later - timedelta(days=1)}),
            ),
            ("wide", write("k7", target_scope="demo", target_namespace_wide=True)),
            ("bad_session", write("k8", session_id="nope")),
            ("no_run", write("k9", run_id="nope")),
            ("escaped", write("k10", arguments={"t": "a\x00b"})),
            ("waiting_running", write("k11", "running", **waiting)),
        ]
    )
    got["run_after"] = await store.get_run("r1")
    got["chain_sound"] = await store.verify_audit_chain("r1")
    k1 = await store.actions.find_by_idempotency_key("k1")
    assert k1 is not None
    got["arguments_k1"] = await store.actions.arguments(k1["id"])
    tables = {
        "runs": "id",
        "audit_events": "run_id, seq",
        "actions": "idempotency_key",
        "approvals": "created_at, action_id",
        "action_secrets": "created_at",
    }
    return {**got, "raw": await _rows(store, tables)}


@pytest.mark.parametrize("scenario", [_opening, _intercepts], ids=["opening", "intercepts"])
async def test_the_store_answers_and_stores_as_pinned(
    store: Store, database_url: str, scenario: Callable[[Store], Awaitable[dict[str, Any]]]
) -> None:
    backend = "sqlite" if database_url.startswith("sqlite") else "postgresql"
    pinned = GOLDEN / f"{scenario.__name__.strip('_')}-{backend}.json"
    got = _normalised(await scenario(store))
    if os.environ.get("ROUNDTABLE_REPIN") == "1":
        pinned.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    assert got == json.loads(pinned.read_text())
