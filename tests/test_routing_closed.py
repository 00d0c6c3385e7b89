"""A run evicted from a worker's cache while one of its calls waits for a
tool worker (workflows/routing.py, ``until_served``) has its coroutine closed
by the garbage collector, outside any workflow (GeneratorExit). Clearing the
call's "waits" line there would run the run's status publishing, a local
activity, outside the workflow's event loop: it raised from the close, an
unraisable exception in a CI run's log. Nothing may be scheduled there."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

from roundtable.models import RunInput, RunState
from workflows.routing import ToolRoutes


class _Waiting:
    """An activity no worker has taken yet: suspends, never resumes."""

    def __await__(self) -> Generator[None, None, None]:
        yield


def _routes(published: list[str]) -> tuple[ToolRoutes, RunState]:
    state = RunState(run_id="run-1", tool_queues={"ticket_update": "roundtable-tools"})
    state.unserved_calls["call-1"] = "ticket_update waits: no tool worker serves it"

    async def publish() -> None:
        published.append("published")

    return ToolRoutes(state, RunInput(task_text="t", run_id="run-1"), publish), state


async def _schedule(_options: dict[str, Any], _prior: bool) -> None:
    await _Waiting()


def test_a_closed_call_waiting_for_a_tool_worker_publishes_nothing() -> None:
    published: list[str] = []
    routes, _state = _routes(published)
    call = routes.until_served("ticket_update", "call-1", _schedule, lambda: False)
    call.send(None)  # waiting for the activity
    call.close()  # evicted: the garbage collector closes it
    assert published == []


def test_a_call_that_ends_clears_its_waits_line() -> None:
    """The same call ending as a call does (its activity failing, here)
    still clears the line it showed, publishing the run's status."""
    published: list[str] = []
    routes, state = _routes(published)
    call = routes.until_served("ticket_update", "call-1", _schedule, lambda: False)
    call.send(None)
    try:
        call.throw(RuntimeError("the activity failed"))
    except RuntimeError:
        pass
    assert published == ["published"]
    assert "call-1" not in state.unserved_calls
