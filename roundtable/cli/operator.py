"""What an operator command may ask, answered the same two ways: directly
(the database and Temporal, roundtable/cli/local.py) or through the HTTP API
(roundtable/cli/remote.py). Both answer with the same documents (the public
views of roundtable/views.py, which the API serves too), so a command prints
the same thing whichever way it went, and fails with the same exit code."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Protocol, TypeVar

from roundtable.cli.endpoint import resolve
from roundtable.cli.local import Local
from roundtable.cli.output import run_or_fail
from roundtable.cli.remote import Remote
from roundtable.models import RunInput

T = TypeVar("T")


class Operator(Protocol):
    #: The options that send another command the same way (printed in hints).
    via: tuple[str, ...]
    #: What a command printed with ``via`` needs besides, said once beside it.
    via_note: str | None

    async def start(self, request: RunInput, idempotency_key: str | None = None) -> dict[str, Any]:
        """``{run_id, workflow_id, status}``; the run's owner is the request's
        ``user_id`` if it was set, else (directly) local-user or (API) the token's.
        The same ``idempotency_key`` (and owner) again starts nothing: it
        answers with the run the first start made (a different request under
        it is a conflict). Through the API a start always carries one."""
        ...

    async def run(self, run_id: str) -> dict[str, Any]:
        """The run's view: status, failure, usage, actions, approvals."""
        ...

    async def final_answer(self, run_id: str) -> str | None: ...

    async def runs(self, status: str | None, user: str | None, limit: int) -> list[dict]: ...

    async def approvals(self, run_id: str | None, status: str | None) -> list[dict]: ...

    async def decide(
        self, approval_id: str, decision: str, reason: str | None, by: str | None
    ) -> dict[str, Any]: ...

    async def reconcile(
        self, action_id: str, outcome: str, note: str, by: str | None
    ) -> dict[str, Any]: ...

    async def recover(self, run_id: str, note: str, by: str | None) -> dict[str, Any]:
        """Reset the stalled run to its first task this code does not replay
        (roundtable/recovery.py): ``{run_id, reset_to_event, from_execution,
        execution}``."""
        ...

    async def events(self, run_id: str) -> list[dict[str, Any]]: ...

    def follow(self, run_id: str) -> AsyncIterator[dict[str, Any]]:
        """The run's events as they are written, ending once the run has ended."""
        ...


@asynccontextmanager
async def operator(
    api: str | None, token: str | None, token_file: Path | None
) -> AsyncIterator[Operator]:
    """The API if one is named (option or environment), else the database."""
    endpoint = resolve(api, token, token_file)
    if endpoint is None:
        async with Local.open() as local:
            yield local
    else:
        async with Remote.open(endpoint) as remote:
            yield remote


def ask(
    via: tuple[str | None, str | None, Path | None],
    question: Callable[[Operator], Awaitable[T]],
    as_json: bool,
) -> T:
    """One question for whichever operator ``via`` (api, token, token file)
    names, answered or failed with the command's exit code."""

    async def asked() -> T:
        async with operator(*via) as ops:
            return await question(ops)

    return run_or_fail(asked(), as_json)
