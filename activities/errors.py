"""Store errors as Temporal failures with stable types, so the workflow (and an
update's caller) can tell a conflict from a missing row from a bug."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import wraps
from typing import ParamSpec, TypeVar

from temporalio.exceptions import ApplicationError

from roundtable.names import CONFLICT, FORBIDDEN_PREFIX, INVALID_INPUT, NOT_FOUND
from roundtable.store.errors import (
    ConflictError,
    ForbiddenError,
    InvalidInputError,
    NotFoundError,
)

P = ParamSpec("P")
R = TypeVar("R")


def typed_store_errors(fn: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
    @wraps(fn)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return await fn(*args, **kwargs)
        except ConflictError as exc:
            raise ApplicationError(str(exc), type=CONFLICT, non_retryable=True) from exc
        except NotFoundError as exc:
            raise ApplicationError(str(exc), type=NOT_FOUND, non_retryable=True) from exc
        except InvalidInputError as exc:
            raise ApplicationError(str(exc), type=INVALID_INPUT, non_retryable=True) from exc
        except ForbiddenError as exc:
            raise ApplicationError(
                str(exc), type=FORBIDDEN_PREFIX + exc.code, non_retryable=True
            ) from exc

    return wrapper
