"""This process's CPU per store call on an approved write's path, alone:

    .venv/bin/python -m bench.store_calls [--url URL] [--writes N]

Each of N writes gets a run of its own and an approval, then each call runs
N times in a row (decide, claim, hold, record the outcome, read the action;
then N runs opened, and a write intercepted in each) and its CPU per call is
printed: the worker's event loop and SQLite's thread,
since both are this process. No Temporal, no payloads: what a store change
saves or costs, measured where it happens. Not part of `make bench` (which
times whole runs against bare Temporal); for comparing two versions of the
store, run it on each (SQLite by default, in a temporary directory; any
database URL with --url, whose schema it creates).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from roundtable.config import SECRET_ENV_VAR
from roundtable.store import Store, open_store

Call = Callable[[dict[str, Any], dict[str, Any]], Awaitable[Any]]


async def _waiting_write(store: Store, index: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """A run of its own with one write waiting for a person."""
    session = await store.create_session(user_id="bench", task_text="bench")
    run = await store.create_run(session_id=session["id"], user_id="bench")
    action = await store.create_action(
        {
            "session_id": run["session_id"],
            "run_id": run["id"],
            "agent_id": "seat-1",
            "tool_name": "bench_write",
            "idempotency_key": f"w{index}",
            "target_key": f"bench:target-{index}",
            "risk_level": "R3",
            "status": "waiting_approval",
        }
    )
    approval = await store.create_approval(
        action_id=action["id"], expires_at=datetime.now(UTC) + timedelta(hours=1)
    )
    return action, approval


async def measure(url: str, writes: int) -> dict[str, float]:
    """CPU milliseconds per call, by call."""
    async with open_store(url) as store:
        pairs = [await _waiting_write(store, i) for i in range(writes)]
        tokens: dict[str, int] = {}

        async def claim(action: dict[str, Any], _: dict[str, Any]) -> None:
            claimed = await store.claim_for_execution(action["id"], 30)
            assert claimed.action is not None, claimed.outcome
            tokens[action["id"]] = claimed.action["fencing_token"]

        calls: dict[str, Call] = {
            "decide": lambda _, approval: store.decide_approval(
                approval["id"], "approved", "bench-operator", run_status="running"
            ),
            "claim": claim,
            "hold": lambda action, _: store.hold_action_lease(
                action["id"], tokens[action["id"]], 30
            ),
            "record outcome": lambda action, _: store.record_action_terminal_result(
                action["id"],
                "succeeded",
                {"external_object_id": "T-1"},
                fencing_token=tokens[action["id"]],
                attempt_over=True,
            ),
            "read action": lambda action, _: store.get_action(action["id"]),
        }
        spent: dict[str, float] = {}
        for name, call in calls.items():
            began = time.process_time()
            for action, approval in pairs:
                await call(action, approval)
            spent[name] = 1000 * (time.process_time() - began) / writes
        # A run's own path: its opening (the rows, then the snapshot pinned
        # and kept with its first status), then an auto-approved write
        # intercepted.
        opened: list[dict[str, Any]] = []
        began = time.process_time()
        for index in range(writes):
            run_id = f"bench-run-{index}"
            run = await store.ensure_run(run_id=run_id, user_id="bench", task_text="bench")
            await store.pin_snapshot(run_id, f"{index:064x}", status="running", body="{}")
            opened.append(run)
        spent["open run"] = 1000 * (time.process_time() - began) / writes
        began = time.process_time()
        for index, run in enumerate(opened):
            await store.create_action(_auto_approved(run, index))
        spent["intercept write"] = 1000 * (time.process_time() - began) / writes
        return spent


def _auto_approved(run: dict[str, Any], index: int) -> dict[str, Any]:
    """A write the run's policy approves on its own, as an intercept records it."""
    return {
        "session_id": run["session_id"],
        "run_id": run["id"],
        "agent_id": "seat-1",
        "tool_name": "bench_write",
        "idempotency_key": f"auto-{index}",
        "target_key": f"bench:auto-{index}",
        "risk_level": "R1",
        "status": "approved",
        "arguments": {"ticket_id": f"T-{index}", "body": "on it"},
        "safe_argument_fields": ["ticket_id"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a database URL (default: SQLite in a temporary directory)")
    parser.add_argument("--writes", type=int, default=300)
    args = parser.parse_args()
    # Arguments are sealed at rest: a throwaway key unless one is set.
    os.environ.setdefault(SECRET_ENV_VAR, "bench-" + uuid.uuid4().hex)
    with tempfile.TemporaryDirectory(prefix="roundtable-store-calls-") as directory:
        url = args.url or f"sqlite+aiosqlite:///{directory}/store.db"
        spent = asyncio.run(measure(url, args.writes))
    for name, ms in spent.items():
        print(f"{name:>15}: {ms:.2f} ms CPU per call")


if __name__ == "__main__":
    main()
