"""A run's capability snapshot is kept in the store under its digest, and
its seat turns name the digest instead of carrying the seat's tool specs
(most of a turn's input, sent again every turn). The model must still get
exactly the seat's tools; a digest nobody kept, or a row that is not what
its key says, fails the turn rather than let the model answer without them.
A read carries no snapshot either (nothing read it)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from sqlalchemy import delete, event, update
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowHandle
from temporalio.converter import DataConverter
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from activities.kept_snapshots import (
    SNAPSHOT_NOT_KEPT,
    SNAPSHOT_NOT_READABLE_HERE,
    KeptSnapshots,
    kept_text,
    snapshot_digest,
)
from activities.run_activities import RunActivities
from roundtable.models import (
    CapabilitySnapshot,
    EnsureRunInput,
    SeatGrant,
    TakeTurnInput,
    ToolSpec,
    canonical_digest,
)
from roundtable.store import Store
from roundtable.store.schema import CapabilitySnapshotRow
from roundtable.tools.registry import ToolDefinition, ToolRegistry
from tests.fake_openai import fake_openai, message
from tests.helpers import new_run
from tests.test_openai_adapter import role_of
from tests.workflow_harness import TRUSTING, harness, script, ticket_call


async def scheduled_inputs(
    handle: WorkflowHandle, converter: DataConverter, activity: str = "take_turn"
) -> list[dict[str, Any]]:
    """Every input of ``activity`` the run scheduled, as the history holds it (JSON)."""
    inputs = []
    async for e in handle.fetch_history_events():
        if e.event_type != EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            continue
        attrs = e.activity_task_scheduled_event_attributes
        if attrs.activity_type.name != activity:
            continue
        payloads = list(attrs.input.payloads)
        if converter.payload_codec is not None:
            payloads = await converter.payload_codec.decode(payloads)
        (payload,) = payloads
        inputs.append(json.loads(payload.data))
    return inputs


def spec(name: str) -> ToolSpec:
    return ToolSpec(name=name, description=f"{name}.", side_effect="read", risk_level="R0")


SNAPSHOT = CapabilitySnapshot(
    tools=[spec("look"), spec("peek")],
    agents=[SeatGrant(agent_id="seat-1", tools=["look"]), SeatGrant(agent_id="seat-2", tools=[])],
)


async def test_seat_turns_name_the_kept_snapshot_and_the_model_gets_each_seats_tools(
    tmp_path, monkeypatch
) -> None:
    def replies(body: dict, _n: int) -> dict:
        return message("Final." if role_of(body) == "manager" else "noted")

    async with fake_openai(replies) as fake, harness(tmp_path) as h:
        monkeypatch.setenv("OPENAI_BASE_URL", fake.base_url)
        monkeypatch.setenv("OPENAI_API_KEY", "sk-test-not-real")
        handle = await h.start(
            task_text="t",
            model="openai:m",
            max_rounds=2,
            seats=["seat-1", "seat-2"],
            seat_tools={"seat-1": ["ticket_get", "ticket_update"], "seat-2": ["ticket_get"]},
        )
        assert (await handle.result()).status == "completed"

        digest = (await h.store.get_run(handle.id))["snapshot_digest"]
        kept = CapabilitySnapshot.model_validate_json(await h.store.kept_snapshot(digest))
        assert kept == (await h.state(handle)).snapshot and snapshot_digest(kept) == digest

        turns = await scheduled_inputs(handle, h.client.data_converter)
        seats = [t for t in turns if t["role"] == "seat"]
        assert len(seats) == 4 and len(turns) == 5
        assert all(t["tools_of"] == digest and t["tools"] == [] for t in seats)
        assert all("tools_of" not in t for t in turns if t["role"] == "manager")

        for seat, granted in (
            ("seat-1", {"ticket_get", "ticket_update"}),
            ("seat-2", {"ticket_get"}),
        ):
            sent = fake.for_seat(seat)
            assert len(sent) == 2
            assert all({t["function"]["name"] for t in body["tools"]} == granted for body in sent)


async def test_a_read_carries_no_snapshot_and_still_reads(tmp_path) -> None:
    """A read's input carried the run's whole snapshot, which nothing reads."""
    async with harness(tmp_path) as h:
        handle = await h.start(
            task_text="t", script=script(("seat-1", 1, [ticket_call("ticket_get", "T-1")]))
        )
        assert (await handle.result()).status == "completed"
        (read,) = await scheduled_inputs(handle, h.client.data_converter, "run_read_tool")
        assert read["snapshot"] == {"tools": [], "agents": []}
        (told,) = [m for m in (await h.state(handle)).threads["seat-1"] if m.role == "tool"]
        assert json.loads(told.content)["outcome"] == "succeeded", told.content


@pytest.fixture
def turns(store: Store) -> RunActivities:
    return RunActivities(store, ToolRegistry(), authority=TRUSTING)


def own_run(run_id: str) -> ActivityEnvironment:
    env = ActivityEnvironment()
    env.info = dataclasses.replace(env.info, workflow_id=run_id)
    return env


def seat_turn(run_id: str, digest: str) -> TakeTurnInput:
    return TakeTurnInput(
        run_id=run_id, seat="seat-1", round=1, role="seat", model="scripted", task_text="t",
        tools_of=digest,
        script={"turns": [{"seat": "seat-1", "round": 1, "text": "hi"}], "final": "done"},
    )  # fmt: skip


async def keep(store: Store, run_id: str, snapshot: CapabilitySnapshot = SNAPSHOT) -> str:
    digest = snapshot_digest(snapshot)
    await store.pin_snapshot(run_id, digest, status="running", body=kept_text(snapshot))
    return digest


async def _rows(store: Store) -> list[str]:
    async with store.db.reader() as session:
        return [
            row.digest for row in await session.execute(CapabilitySnapshotRow.__table__.select())
        ]


async def test_runs_sharing_a_snapshot_keep_one_row(store: Store) -> None:
    first, second = await new_run(store), await new_run(store)
    digest = await keep(store, first["id"])
    await keep(store, second["id"])
    await keep(store, second["id"])  # opened again (a reset): still one row
    assert await _rows(store) == [digest]
    assert await store.kept_snapshot(digest) == kept_text(SNAPSHOT)
    assert await store.kept_snapshot("0" * 64) is None


async def test_a_row_that_went_comes_back_with_the_next_opening(store: Store) -> None:
    """Found in review: a store that remembered having written a row wrote
    none after the row went (a restored database)."""
    first, second = await new_run(store), await new_run(store)
    digest = await keep(store, first["id"])
    async with store.db.transaction() as session:
        await session.execute(delete(CapabilitySnapshotRow))
    await keep(store, second["id"])
    assert await _rows(store) == [digest]


def _reading(tool: str, description: str, parameters: dict[str, Any]) -> ToolDefinition:
    async def handler(_args: Any, _ctx: Any) -> dict[str, Any]:
        return {}

    return ToolDefinition(
        name=tool, description=description, side_effect="read", risk_level="R0",
        handler=handler, input_schema=parameters,
    )  # fmt: skip


# Values the store's JSON columns do not read back as written (found in review:
# a snapshot kept as JSON came back other than digested, on both databases, and
# every turn on a worker that had not opened the run failed).
AWKWARD = {
    "a whole float with an exponent (an MCP schema's bound)": (
        "d",
        {"type": "object", "properties": {"n": {"type": "number", "maximum": 1e16}}},
    ),
    "the largest float": ("d", {"type": "number", "maximum": 1.7976931348623157e308}),
    "a big float bound": ("d", {"type": "number", "exclusiveMaximum": 1e21}),
    # (A lone surrogate cannot arrive: the MCP SDK's JSON parser refuses it.)
    "NUL in a description": ("a\x00b", {"type": "object"}),
}


@pytest.mark.parametrize("case", list(AWKWARD))
async def test_a_worker_that_did_not_open_the_run_gets_exactly_its_tools(
    store: Store, case: str
) -> None:
    description, parameters = AWKWARD[case]
    registry = ToolRegistry()
    registry.register(_reading("look", description, parameters))
    opener = RunActivities(store, registry, authority=TRUSTING)
    opening = EnsureRunInput(
        run_id="run-awkward", user_id="u", task_text="t", seats=["seat-1"],
        open_as="running", keep_snapshot=True,
    )  # fmt: skip
    opened = await own_run("run-awkward").run(opener.ensure_run, opening)
    assert opened.snapshot_digest == snapshot_digest(opened.snapshot)
    # Another worker (or this one restarted): nothing in memory, the row read.
    other = RunActivities(store, ToolRegistry(), authority=TRUSTING)
    given = await other._tools(seat_turn("run-awkward", opened.snapshot_digest))
    assert given == opened.snapshot.tools_for("seat-1") == [registry.tools["look"].spec()]


async def test_a_turn_reads_the_snapshot_once_per_worker(
    store: Store, turns: RunActivities
) -> None:
    run = await new_run(store)
    digest = await keep(store, run["id"])
    statements: list[str] = []

    def note(_conn, _cursor, statement, *_args) -> None:  # type: ignore[no-untyped-def]
        statements.append(statement)

    event.listen(store.engine.sync_engine, "before_cursor_execute", note)
    try:
        for _ in range(3):
            await own_run(run["id"]).run(turns.take_turn, seat_turn(run["id"], digest))
        assert await turns._tools(seat_turn(run["id"], digest)) == [spec("look")]
    finally:
        event.remove(store.engine.sync_engine, "before_cursor_execute", note)
    assert sum("capability_snapshots" in s for s in statements) == 1, statements


def test_what_a_worker_holds_is_bounded_by_count_and_by_size() -> None:
    held = KeptSnapshots(store=None, count=3, size=100)  # type: ignore[arg-type]
    for n in range(5):
        held.remember(f"d{n}", SNAPSHOT, 10)
    assert list(held._known) == ["d2", "d3", "d4"]
    held.remember("big", SNAPSHOT, 90)  # 10 + 10 + 90 > 100: the oldest go
    assert list(held._known) == ["d4", "big"]
    held.remember("huge", SNAPSHOT, 500)  # larger than the bound: held alone
    assert list(held._known) == ["huge"]


async def test_a_turn_naming_a_snapshot_nobody_kept_fails_without_retrying(
    store: Store, turns: RunActivities
) -> None:
    run = await new_run(store)
    with pytest.raises(ApplicationError) as refused:
        await own_run(run["id"]).run(turns.take_turn, seat_turn(run["id"], "0" * 64))
    assert refused.value.type == SNAPSHOT_NOT_KEPT and refused.value.non_retryable


async def test_a_kept_row_that_is_not_what_its_digest_names_is_refused(
    store: Store, turns: RunActivities
) -> None:
    run = await new_run(store)
    digest = await keep(store, run["id"])
    # Someone widens seat-1's grant in the row behind the digest's back.
    widened = SNAPSHOT.model_copy(
        update={"agents": (SeatGrant(agent_id="seat-1", tools=("look", "peek")),)}
    )
    async with store.db.transaction() as session:
        await session.execute(
            update(CapabilitySnapshotRow)
            .where(CapabilitySnapshotRow.digest == digest)
            .values(body=kept_text(widened))
        )
    with pytest.raises(ApplicationError) as refused:
        await own_run(run["id"]).run(turns.take_turn, seat_turn(run["id"], digest))
    assert refused.value.type == SNAPSHOT_NOT_KEPT and refused.value.non_retryable
    assert "not the one it names" in str(refused.value)


async def test_a_snapshot_in_a_newer_releases_form_is_retried_not_failed(
    store: Store, turns: RunActivities
) -> None:
    """A newer release's snapshot (a field this worker's models do not know)
    during a rolling deploy: the turn is retried, for a worker that knows it
    to take, not failed for good (found in review)."""
    run = await new_run(store)
    newer = SNAPSHOT.model_dump(mode="json")
    newer["tools"][0]["cost_hint"] = "cheap"
    digest = canonical_digest(newer) or ""
    await store.pin_snapshot(run["id"], digest, body=json.dumps(newer))
    with pytest.raises(ApplicationError) as refused:
        await own_run(run["id"]).run(turns.take_turn, seat_turn(run["id"], digest))
    assert refused.value.type == SNAPSHOT_NOT_READABLE_HERE
    assert not refused.value.non_retryable


async def test_a_turn_that_carries_its_specs_is_given_them(
    store: Store, turns: RunActivities
) -> None:
    """Runs opened before snapshots were kept (their recorded turns carry specs)."""
    run = await new_run(store)
    carried = seat_turn(run["id"], "unused").model_copy(
        update={"tools_of": None, "tools": [spec("peek")]}
    )
    assert await turns._tools(carried) == [spec("peek")]
