"""What people see of runs and approvals: one builder for the CLI and the API,
made of the allowlisted public views only."""

from __future__ import annotations

from typing import Any

from roundtable.security import action_to_public_dict, approval_to_public_dict
from roundtable.store import Store


async def approval_view(store: Store, approval: dict[str, Any]) -> dict[str, Any]:
    action = await store.get_action(approval["action_id"])
    view = approval_to_public_dict(approval, action)
    view["arguments_digest"] = action["arguments_digest"]
    return view


async def run_view(store: Store, run_id: str) -> dict[str, Any]:
    run = await store.get_run(run_id)
    actions = await store.list_actions(run_id)
    by_id = {a["id"]: a for a in actions}
    approvals = []
    for approval in await store.list_approvals(run_id=run_id):
        view = approval_to_public_dict(approval, by_id.get(approval["action_id"]))
        view["arguments_digest"] = by_id[approval["action_id"]]["arguments_digest"]
        approvals.append(view)
    turns = [
        e["payload"] for e in await store.list_events(run_id) if e["event_type"] == "turn.completed"
    ]
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


def event_view(event: dict[str, Any]) -> dict[str, Any]:
    """Audit events carry no secrets by construction (the store refuses them)."""
    return {
        "seq": event["seq"],
        "event_type": event["event_type"],
        "payload": event["payload"],
        "created_at": event["created_at"].isoformat(),
        "hash": event["hash"],
    }
