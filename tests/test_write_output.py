"""What execute_write reports is what the store holds: the workflow (and the
model after it) is told the status and result the action row keeps, on
both databases, whether the attempt's own record said it or the store had
to be read again (someone made the action unknown while it ran)."""

from __future__ import annotations

import math
from datetime import UTC, datetime
from typing import Any

import pytest
from pydantic import BaseModel
from temporalio.testing import ActivityEnvironment

from activities.write_activities import WriteActivities
from roundtable.models import ExecuteWriteInput
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
    output = await ActivityEnvironment().run(writes.execute_write, inp)
    return output, await store.get_action(action["id"])


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


class _Opaque:
    """Something JSON cannot write, that says what it is."""

    def __str__(self) -> str:
        return "an opaque answer"


class _Unprintable:
    def __str__(self) -> str:
        raise RuntimeError("no text for you")


def _circular() -> dict[str, Any]:
    loop: dict[str, Any] = {"id": "T-1"}
    loop["self"] = loop
    return loop


@pytest.mark.parametrize(
    ("answer", "kept"),
    [
        (["a", "list"], {"value": ["a", "list"]}),
        ("done", {"value": "done"}),
        (42, {"value": 42}),
        ({"when": datetime(2026, 12, 6, tzinfo=UTC)}, {"when": "2026-12-06 00:00:00+00:00"}),
        ({"thing": _Opaque(), "ids": {"T-1"}}, {"thing": "an opaque answer", "ids": "{'T-1'}"}),
        ({"thing": _Unprintable()}, {"thing": "<_Unprintable>"}),
        ({("a", "b"): 1}, {"value": "{('a', 'b'): 1}"}),
        (_circular(), {"value": "{'id': 'T-1', 'self': {...}}"}),
        (b"bytes", {"value": "b'bytes'"}),
    ],
    ids=[
        "list",
        "text",
        "number",
        "datetime",
        "objects",
        "unprintable",
        "tuple-key",
        "circular",
        "bytes",
    ],
)
async def test_an_answer_that_is_not_a_json_object_still_ends_the_write_succeeded(
    store, answer, kept
) -> None:
    """The tool ran to its end and said so: its write is done, whatever the
    shape of its answer. Before, such an answer failed the record after the
    call, and the write was left for an operator to reconcile as unknown."""
    output, stored = await _executed(store, answer, "shapeless")
    assert stored["status"] == "succeeded"
    assert stored["result"] == kept
    assert (output.status, output.result) == (stored["status"], stored["result"])
