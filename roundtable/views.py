"""What people see of runs and approvals: one builder for the CLI and the API,
made of the allowlisted public views only.

Each view is built from one snapshot of the store (see store/reads.py), so it
never shows an approval without its action, or usage from a later instant.
"""

from __future__ import annotations

from typing import Any

from roundtable.security import action_to_public_dict, approval_to_public_dict
from roundtable.store import NotFoundError, Store


def approval_pair_view(approval: dict[str, Any], action: dict[str, Any]) -> dict[str, Any]:
    """An approval with what it approves (tool, seat, redacted arguments)."""
    view = approval_to_public_dict(approval, action)
    view["arguments_digest"] = action["arguments_digest"]
    return view


async def approval_view(store: Store, approval: dict[str, Any]) -> dict[str, Any]:
    pairs = await store.approvals_with_actions(approval_id=approval["id"])
    if not pairs:
        raise NotFoundError(f"approval {approval['id']!r} not found")
    return approval_pair_view(*pairs[0])


async def approval_views(store: Store, **filters: Any) -> list[dict[str, Any]]:
    """Approvals (filtered as ``Store.approvals_with_actions``) in one query."""
    return [approval_pair_view(*pair) for pair in await store.approvals_with_actions(**filters)]


async def run_view(store: Store, run_id: str) -> dict[str, Any]:
    snapshot = await store.run_snapshot(run_id)
    run, actions, turns = snapshot["run"], snapshot["actions"], snapshot["turns"]
    by_id = {a["id"]: a for a in actions}
    # One snapshot: every approval's action is among the actions read.
    approvals = [approval_pair_view(a, by_id[a["action_id"]]) for a in snapshot["approvals"]]
    return {
        "run_id": run["id"],
        "user_id": run["user_id"],
        "status": run["status"],
        # Why it failed, was terminated or is stalled: {"code", "message"}.
        "failure": run["failure"],
        "usage": {
            "turns": len(turns),
            "prompt_tokens": sum(t["prompt_tokens"] for t in turns),
            "completion_tokens": sum(t["completion_tokens"] for t in turns),
        },
        "created_at": run["created_at"].isoformat(),
        "updated_at": run["updated_at"].isoformat(),
        "actions": [action_to_public_dict(a) for a in actions],
        "approvals": approvals,
    }


def run_summary(run: dict[str, Any]) -> dict[str, Any]:
    """A run as lists show it."""
    return {
        "run_id": run["id"],
        "user_id": run["user_id"],
        "status": run["status"],
        "created_at": run["created_at"].isoformat(),
        "updated_at": run["updated_at"].isoformat(),
    }


def event_view(event: dict[str, Any]) -> dict[str, Any]:
    """Audit events carry no secrets by construction (the store refuses them)."""
    return {
        "seq": event["seq"],
        "event_type": event["event_type"],
        "payload": event["payload"],
        "created_at": event["created_at"].isoformat(),
        "hash": event["hash"],
    }
