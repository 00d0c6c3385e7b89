"""What execute_write reports is what the store holds: the workflow (and the
model after it) is told the status and result the action row keeps, on
both databases, whether the attempt's own record said it or the store had
to be read again (someone made the action unknown while it ran)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import types
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import pytest
from pydantic import BaseModel
from temporalio.testing import ActivityEnvironment

from activities import tool_answers
from activities.write_activities import WriteActivities
from roundtable.models import ExecuteWriteInput
from roundtable.security import REDACTED
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


async def _executed(
    store: Any, answer: Any, key: str, object_id: str | None = None
) -> tuple[Any, dict[str, Any]]:
    run = await new_run(store)
    action = await new_action(
        store,
        run,
        key=key,
        arguments={"tenant_id": "tenant-a", "object_id": object_id or key},
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


def _nested(depth: int) -> dict[str, Any]:
    answer: dict[str, Any] = {"id": "T-1"}
    for _ in range(depth):
        answer = {"in": answer}
    return answer


def _nested_kept(depth: int) -> dict[str, Any]:
    kept: Any = "<nested too deep>"
    for _ in range(depth):
        kept = {"in": kept}
    return kept


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
        ({"thing": _Opaque(), "ids": {"T-1"}}, {"thing": "an opaque answer", "ids": ["T-1"]}),
        ({"thing": _Unprintable()}, {"thing": "<_Unprintable>"}),
        (
            {("a", "b"): 1, 7: "seven", "7": "text"},
            {"('a', 'b')": 1, "7": "seven", "7 (2)": "text"},
        ),
        (_circular(), {"id": "T-1", "self": "<cycle>"}),
        (b"caf\xc3\xa9 \xff", {"value": "caf\u00e9 \\xff"}),
        (types.MappingProxyType({"id": "T-1"}), {"id": "T-1"}),
        ({"n": Decimal("4.8291E+5"), "x": Decimal("1.5")}, {"n": 482910, "x": 1.5}),
        ({"id": "T-9", "n": 10**5000}, {"id": "T-9", "n": f"{10**5000:#x}"}),
        (_nested(100), _nested_kept(tool_answers.DEEPEST)),
    ],
    ids=[
        "list",
        "text",
        "number",
        "datetime",
        "objects",
        "unprintable",
        "keys",
        "circular",
        "bytes",
        "mapping",
        "decimal",
        "huge-int",
        "deep",
    ],
)
async def test_an_answer_that_is_not_a_json_object_still_ends_the_write_succeeded(
    store, answer, kept
) -> None:
    """The tool ran to its end and said so: its write is done, whatever the
    shape of its answer, kept value by value. Before, such an answer failed
    the record after the call, and the write was left for an operator to
    reconcile as unknown."""
    output, stored = await _executed(store, answer, "shapeless")
    assert stored["status"] == "succeeded"
    assert stored["result"] == kept
    assert (output.status, output.result) == (stored["status"], stored["result"])


# Found by the review of the first version, which made a whole answer its
# text when JSON could not take it, and any unwritable value its str().


def _fire_and_forget() -> Any:
    async def the_write() -> None:
        await asyncio.sleep(3600)

    return asyncio.ensure_future(the_write())


async def _never_awaited() -> dict[str, Any]:
    return {"id": "T-1"}


async def _lazy() -> Any:
    yield {"id": "T-1"}


def _in_a_thread() -> Any:
    return concurrent.futures.Future()


@pytest.mark.parametrize(
    "unfinished",
    [_fire_and_forget, _never_awaited, _lazy, _in_a_thread, lambda: {"id": _never_awaited()}],
    ids=["task", "coroutine", "async-generator", "future", "nested"],
)
async def test_an_answer_of_work_not_yet_done_leaves_the_write_unknown_and_its_target_held(
    store, unfinished
) -> None:
    """A handler that answers with work it did not await has not finished
    its write, or never started it: nothing says which. The write is
    unknown, its lease left to run out, so no second writer takes the target
    while the first may still write."""
    answer = unfinished()
    output, stored = await _executed(store, answer, "unfinished")
    assert (stored["status"], stored["result"]["error_code"]) == ("unknown", "answer_not_awaited")
    assert (output.status, output.result) == (stored["status"], stored["result"])
    assert await store.live_lease_action_ids() == {stored["id"]}
    if isinstance(answer, asyncio.Task):
        answer.cancel()


SECRET = "pässwört-ünd-gëheim-42"


@pytest.mark.parametrize(
    ("secret", "answer"),
    [
        (SECRET, {"echo": SECRET.encode()}),  # an HTTP client's body, as bytes
        ("T1", {("a", "b"): 1, "object_id": "T1"}),  # a short one, by its own name
        ("T1", types.MappingProxyType({"object_id": "T1"})),
        ("T1", {"headers": types.MappingProxyType({"object_id": "T1"})}),
        ("482910", {"echo": Decimal("4.8291E+5")}),  # by value, as a Decimal
    ],
    ids=["bytes", "odd-key", "mapping", "nested-mapping", "decimal"],
)
async def test_a_secret_echoed_in_an_odd_shape_is_still_redacted(store, secret, answer) -> None:
    output, stored = await _executed(store, answer, "echo", object_id=secret)
    assert stored["status"] == "succeeded"
    assert secret not in str(stored["result"])
    assert "482910" not in str(stored["result"])
    assert REDACTED in str(stored["result"])
    assert output.result == stored["result"]
