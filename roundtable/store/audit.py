"""Append-only, per-run, hash-chained audit events.

Each event's hash covers the previous hash and the event's own content, so a
removed, reordered or edited event breaks the chain (see :func:`verify_chain`).
The chain head is kept on the run row; updating it inside the caller's
transaction also serialises concurrent appends to one run.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession

from roundtable.store.schema import AuditEventRow, RunRow
from roundtable.store.text import escape_json

GENESIS_HASH = "0" * 64

# Keys that must never reach an audit payload, at any depth. Callers build
# payloads from ids and statuses; this is the backstop.
_FORBIDDEN_PAYLOAD_KEYS = frozenset(
    {"arguments", "arguments_encrypted", "target_key", "idempotency_key", "secret", "token"}
)


def event_hash(
    prev_hash: str,
    run_id: str,
    seq: int,
    event_type: str,
    payload: Mapping[str, Any],
    created_at: datetime,
) -> str:
    body = json.dumps(
        {
            "run_id": run_id,
            "seq": seq,
            "type": event_type,
            "payload": payload,
            "created_at": created_at.isoformat(),
        },
        sort_keys=True,
        separators=(",", ":"),
        default=str,
    )
    return hashlib.sha256((prev_hash + body).encode()).hexdigest()


def _check_payload(payload: Any) -> None:
    if isinstance(payload, Mapping):
        for key, value in payload.items():
            if key in _FORBIDDEN_PAYLOAD_KEYS:
                raise ValueError(f"audit payload must not carry {key!r}")
            _check_payload(value)
    elif isinstance(payload, list):
        for item in payload:
            _check_payload(item)


async def append_event(
    session: AsyncSession,
    run: RunRow,
    event_type: str,
    payload: Mapping[str, Any],
    now: datetime,
    dedupe_key: str | None = None,
) -> AuditEventRow:
    """Append to ``run``'s chain. ``run`` must be the row locked by this transaction.
    Text the database cannot store (from models and tools) is escaped before
    hashing, so the chain covers exactly what is kept. Rows added before the
    event are written first, so the rows an event speaks of exist before it;
    changes to existing rows, and the events themselves, wait for the next
    flush (a transaction's events go in together, its chain head once)."""
    if any(not isinstance(row, AuditEventRow) for row in session.new):
        await session.flush()
    _check_payload(payload)
    payload = escape_json(payload)
    seq = run.last_event_seq + 1
    digest = event_hash(run.last_event_hash, run.id, seq, event_type, payload, now)
    row = AuditEventRow(
        run_id=run.id,
        seq=seq,
        event_type=event_type,
        payload=dict(payload),
        prev_hash=run.last_event_hash,
        hash=digest,
        dedupe_key=dedupe_key,
        created_at=now,
    )
    session.add(row)
    run.last_event_seq = seq
    run.last_event_hash = digest
    run.updated_at = now
    return row


def chained_event(
    run_id: str,
    last_seq: int,
    last_hash: str,
    event_type: str,
    payload: Mapping[str, Any],
    now: datetime,
    dedupe_key: str | None = None,
) -> dict[str, Any]:
    """The next event of a run whose chain head is (``last_seq``,
    ``last_hash``), as column values, for callers that write the event and the
    new head with statements of their own (the claim). The same checks,
    escaping and hash as :func:`append_event`; the caller must hold the run
    lock and set the run's head to the returned ``seq`` and ``hash``."""
    _check_payload(payload)
    payload = escape_json(payload)
    seq = last_seq + 1
    return {
        "run_id": run_id,
        "seq": seq,
        "event_type": event_type,
        "payload": dict(payload),
        "prev_hash": last_hash,
        "hash": event_hash(last_hash, run_id, seq, event_type, payload, now),
        "dedupe_key": dedupe_key,
        "created_at": now,
    }


def verify_chain(events: Iterable[Mapping[str, Any]]) -> bool:
    """True when ``events`` (in sequence order) form an unbroken chain from genesis."""
    prev = GENESIS_HASH
    for expected_seq, event in enumerate(events, start=1):
        if event["seq"] != expected_seq or event["prev_hash"] != prev:
            return False
        digest = event_hash(
            prev,
            event["run_id"],
            event["seq"],
            event["event_type"],
            event["payload"],
            event["created_at"],
        )
        if digest != event["hash"]:
            return False
        prev = digest
    return True
