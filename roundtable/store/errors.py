"""Typed store errors with stable codes, mapped once to HTTP statuses and exit codes."""

from __future__ import annotations

from datetime import datetime


class StoreError(Exception):
    code = "store_error"


class NotFoundError(StoreError, LookupError):
    """No such session, run, action or approval."""

    code = "not_found"


class ConflictError(StoreError):
    """The row is no longer in the state the operation needs (HTTP 409)."""

    code = "conflict"


class ForbiddenError(StoreError, PermissionError):
    """The caller may not do this, whatever the state (HTTP 403); subclasses
    name the rule in ``code``."""

    code = "forbidden"


def forbidden(code: str, message: str) -> ForbiddenError:
    """A ForbiddenError naming its rule, rebuilt from a Temporal failure."""
    error = ForbiddenError(message)
    error.code = code
    return error


class InvalidInputError(StoreError, ValueError):
    """The request itself is malformed; nothing was written. ``field`` names
    the offending input when it is known."""

    code = "invalid_input"

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class AttemptMayBeRunningError(ConflictError):
    """Reconciliation refused: the action's executing attempt may still be
    running until its lease runs out at ``retry_at``."""

    code = "attempt_may_be_running"

    def __init__(self, action_id: str, retry_at: datetime, message: str | None = None) -> None:
        super().__init__(
            message
            or f"action {action_id!r} may still be executing: its attempt holds the target's "
            f"lease until {retry_at.isoformat()}, and whatever the real system shows now "
            "could still change. Reconcile after that time."
        )
        self.retry_at = retry_at


class SchemaOutOfDateError(StoreError):
    """The database's schema is not the one this code needs."""

    def __init__(self, current: str | None, needed: str) -> None:
        found = f"at revision {current}" if current else "empty (no schema yet)"
        super().__init__(
            f"the database schema is {found}; this Roundtable needs revision {needed}: "
            "run `roundtable db upgrade` (the worker and `roundtable dev` also upgrade it)"
        )
        self.current, self.needed = current, needed


class SchemaNewerError(SchemaOutOfDateError):
    """The database was migrated by a newer release than this one: nothing
    this code knows can bring it to its own revision."""

    def __init__(self, current: str, needed: str) -> None:
        StoreError.__init__(
            self,
            f"the database schema is at revision {current}, newer than this Roundtable "
            f"knows (it needs {needed}): a newer release upgraded it; run that release, "
            "or see docs/architecture.md §7 on rolling back",
        )
        self.current, self.needed = current, needed
