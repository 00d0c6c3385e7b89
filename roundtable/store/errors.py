"""Typed store errors with stable codes, mapped once to HTTP statuses and exit codes."""

from __future__ import annotations


class StoreError(Exception):
    code = "store_error"


class NotFoundError(StoreError, LookupError):
    """No such session, run, action or approval."""

    code = "not_found"


class ConflictError(StoreError):
    """The row is no longer in the state the operation needs (HTTP 409)."""

    code = "conflict"


class InvalidInputError(StoreError, ValueError):
    """The request itself is malformed; nothing was written."""

    code = "invalid_input"
