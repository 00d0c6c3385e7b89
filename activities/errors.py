"""Store errors as Temporal failures with stable types, so the workflow (and an
update's caller) can tell a conflict from a missing row from a bug.

They are expected outcomes (a refused decision, a conflict), not faults: each
is logged as one line here, and marked benign, so the SDK logs it at debug
level instead of a warning with a traceback (and leaves it out of its
failure metrics)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from functools import wraps
from typing import ParamSpec, TypeVar

from temporalio.exceptions import ApplicationError, ApplicationErrorCategory

from roundtable.names import CONFLICT, FORBIDDEN_PREFIX, INVALID_INPUT, NOT_FOUND
from roundtable.store.errors import (
    ConflictError,
    ForbiddenError,
    InvalidInputError,
    NotFoundError,
)

P = ParamSpec("P")
R = TypeVar("R")


log = logging.getLogger("roundtable.activities")


def log_refusal(what: str, kind: str, exc: Exception) -> None:
    """One line for an expected refusal, with the ids the activity bound; its
    traceback at debug level (a refusal a bug caused can still be traced)."""
    log.info("%s refused (%s): %s", what, kind, exc)
    log.debug("%s refused here", what, exc_info=exc)


def _refused(fn: Callable[..., object], kind: str, exc: Exception) -> ApplicationError:
    log_refusal(fn.__name__, kind, exc)
    return ApplicationError(
        str(exc), type=kind, non_retryable=True, category=ApplicationErrorCategory.BENIGN
    )


def typed_store_errors(fn: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
    @wraps(fn)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return await fn(*args, **kwargs)
        except ConflictError as exc:
            raise _refused(fn, CONFLICT, exc) from exc
        except NotFoundError as exc:
            raise _refused(fn, NOT_FOUND, exc) from exc
        except InvalidInputError as exc:
            raise _refused(fn, INVALID_INPUT, exc) from exc
        except ForbiddenError as exc:
            raise _refused(fn, FORBIDDEN_PREFIX + exc.code, exc) from exc

    return wrapper
