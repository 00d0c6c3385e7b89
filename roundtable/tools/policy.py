"""Write policies: who must say yes before a write may run."""

from __future__ import annotations

from roundtable.states import ActionStatus

RISK_ORDER = ("R0", "R1", "R2", "R3")
AUTO_APPROVE_PREFIX = "auto_approve_up_to:"


def initial_action_status(write_policy: str, risk_level: str) -> ActionStatus:
    """``confirm_all_writes``: every write waits for a person.
    ``auto_approve_up_to:R1``: writes at or below R1 start approved, the rest wait.
    ``deny_writes``: every write is refused (and still recorded)."""
    if write_policy == "confirm_all_writes":
        return ActionStatus.WAITING_APPROVAL
    if write_policy == "deny_writes":
        return ActionStatus.REJECTED
    if write_policy.startswith(AUTO_APPROVE_PREFIX):
        ceiling = write_policy.removeprefix(AUTO_APPROVE_PREFIX)
        if ceiling in RISK_ORDER and risk_level in RISK_ORDER:
            if RISK_ORDER.index(risk_level) <= RISK_ORDER.index(ceiling):
                return ActionStatus.APPROVED
            return ActionStatus.WAITING_APPROVAL
    raise ValueError(f"unknown write policy {write_policy!r}")
