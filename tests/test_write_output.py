"""What execute_write reports is what the store holds: the workflow (and the
model after it) is told the status and result the action row keeps, on
both databases, whether the attempt's own record said it or the store had
to be read again (someone made the action unknown while it ran)."""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import pytest
from pydantic import BaseModel
from temporalio.testing import ActivityEnvironment

from activities.write_activities import WriteActivities
from roundtable.models import ActionRef, ExecuteWriteInput
from roundtable.tools.registry import ToolDefiniteFailure, ToolDefinition, ToolRegistry
from tests.helpers import WRITE_TOOL, new_action, new_run, target_fields
from tests.workflow_harness import TRUSTING

# Values a tool may answer with that no database keeps as written: NUL and a
# lone surrogate (escaped as text), NaN and the infinities (kept as their
# names), an integral float JSON writes with an exponent (kept as the
# integer), a tuple (a JSON array), a key that is not text.
AWKWARD: dict[Any, Any] = {
    "ticket": "T-1\x00",
    "note": "half \ud800 a pair",
    "nan": math.nan,
    "big": 1e16,
    "limits": (math.inf, -math.inf),
    "nested": {"deep": ["a\x00b", 1.5, None, True]},
    7: "a key that is a number",
}


class _Arguments(BaseModel):
    tenant_id: str
    object_id: str


def _registry(answer: Any) -> ToolRegistry:
    async def handler(_args: Any, _ctx: Any) -> Any:
        if isinstance(answer, BaseException):
            raise answer
        return answer

    registry = ToolRegistry()
    registry.register(
        ToolDefinition(
            name=WRITE_TOOL,
            description="Write something.",
            side_effect="write",
            risk_level="R3",
            handler=handler,
            args_model=_Arguments,
            target_key_fields=("tenant_id", "object_id"),
            target_key_namespace="lease-test",
            effects_end_with_call=True,
        )
    )
    return registry


async def _executed(store: Any, answer: Any, key: str) -> tuple[Any, dict[str, Any]]:
    writes, inp = await _approved_write(store, answer, key)
    output = await ActivityEnvironment().run(writes.execute_write, inp)
    return output, await store.get_action(inp.action_id)


async def _approved_write(store: Any, answer: Any, key: str) -> tuple[Any, ExecuteWriteInput]:
    """An approved write of a tool that answers ``answer``, ready to execute."""
    run = await new_run(store)
    action = await new_action(
        store,
        run,
        key=key,
        arguments={"tenant_id": "tenant-a", "object_id": key},
        **target_fields(key),
    )
    writes = WriteActivities(store, _registry(answer), authority=TRUSTING)
    inp = ExecuteWriteInput(
        action_id=action["id"], seat="seat-1", lease_seconds=30, heartbeat_interval_seconds=1
    )
    return writes, inp


@pytest.mark.parametrize(
    "answer",
    [{"ok": True, "id": "T-1"}, AWKWARD, {}],
    ids=["plain", "awkward", "empty"],
)
async def test_the_reported_outcome_is_the_stored_one(store, answer) -> None:
    output, stored = await _executed(store, answer, "reported")
    assert stored["status"] == "succeeded"
    assert (output.status, output.result) == (stored["status"], stored["result"])


async def test_a_failure_reported_is_the_stored_one(store) -> None:
    """A tool that says nothing happened: a definite failure, as stored."""
    refused = ToolDefiniteFailure("no_such_ticket", "T-1\x00 is not there")
    output, stored = await _executed(store, refused, "failed")
    assert stored["status"] == "failed"
    assert (output.status, output.result) == (stored["status"], stored["result"])


@dataclass
class _Job:
    """A tool's own object: JSON cannot write it, and it may hold anything."""

    ticket: str
    pending: Any = None


async def _in_flight() -> Any:
    return asyncio.ensure_future(asyncio.sleep(3600))


@pytest.mark.parametrize(
    "answer",
    [
        lambda: ["a", "list"],
        lambda: "done",
        lambda: {"when": datetime(2026, 12, 6, tzinfo=UTC)},
        lambda: {"job": _Job("T-1")},
        lambda: {"body": b"bytes"},
        _in_flight,
    ],
    ids=["list", "text", "datetime", "object", "bytes", "task"],
)
async def test_an_answer_that_is_not_json_leaves_the_write_unknown_and_its_target_held(
    store, answer
) -> None:
    """A handler is to answer with a JSON object of JSON values. Any other
    answer fails the record after the call, and the write ends unknown for an
    operator, its target held: fail closed. Keeping such answers was tried
    (791eff4) and taken back: an object JSON cannot write may hold work still
    in flight (a task, a scheduled callback) or a secret the redactor cannot
    see inside it, and no walk of arbitrary objects finds every one (two
    adversarial reviews found a dozen ways past it)."""
    made = answer()
    if asyncio.iscoroutine(made):
        made = await made
    writes, inp = await _approved_write(store, made, "not-json")
    with pytest.raises(Exception):  # noqa: B017 (which error is not the point)
        await ActivityEnvironment().run(writes.execute_write, inp)
    executing = await store.get_action(inp.action_id)
    assert executing["status"] == "executing"
    settled = await ActivityEnvironment().run(
        writes.settle_write, ActionRef(action_id=inp.action_id)
    )
    assert settled.status == "unknown"
    assert await store.live_lease_action_ids() == {inp.action_id}
    if isinstance(made, asyncio.Task):
        made.cancel()
