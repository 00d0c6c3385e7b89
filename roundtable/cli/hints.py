"""The commands we print for people to run next (`roundtable dev`, `start
--wait`): whole, so that pasted into any shell, in any directory, they work."""

from __future__ import annotations

import shlex
import shutil
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from roundtable.store import FINAL_RUN_STATUSES


def cli_program() -> str:
    """This CLI: by name when that is what the shell finds, else its absolute
    path (a path relative to where it was printed breaks anywhere else)."""
    venv_cli = Path(sys.executable).parent / "roundtable"
    if not venv_cli.exists():
        return "roundtable"
    found = shutil.which("roundtable")
    if found is not None and Path(found).resolve() == venv_cli.resolve():
        return "roundtable"
    return str(venv_cli.absolute())


def command(*args: str, via: Sequence[str] = ()) -> str:
    return shlex.join([cli_program(), *args, *via])


def news(view: dict[str, Any], told: set[str], via: Sequence[str]) -> Iterable[str]:
    """What a run waits for that has not been told yet, each with the
    command that gives it: a pending approval, an action whose outcome is
    unknown. ``view`` is a run's view (roundtable/views.py run_view)."""
    for approval in view["approvals"]:
        if approval["status"] == "pending" and approval["id"] not in told:
            told.add(approval["id"])
            yield (
                f"waiting for approval: {approval['tool_name']} by {approval['agent_id']} "
                f"{approval['arguments']}\n"
                f"  approve: {command('approve', approval['id'], via=via)}\n"
                f"  reject:  {command('reject', approval['id'], '--reason', '…', via=via)}"
            )
    for action in view["actions"]:
        if action["status"] == "unknown" and action["id"] not in told:
            told.add(action["id"])
            settle = ("reconcile", action["id"], "--outcome", "succeeded|failed", "--note", "…")
            yield (
                f"outcome unknown: {action['tool_name']} by {action['agent_id']}\n"
                f"  reconcile: {command(*settle, via=via)}"
            )


def ended(view: dict[str, Any]) -> bool:
    return view["status"] in FINAL_RUN_STATUSES
