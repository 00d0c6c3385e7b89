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
from sqlalchemy import event, update
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowHandle
from temporalio.converter import DataConverter
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from activities.kept_snapshots import SNAPSHOT_NOT_KEPT, snapshot_digest
from activities.run_activities import RunActivities
from roundtable.models import CapabilitySnapshot, SeatGrant, TakeTurnInput, ToolSpec
from roundtable.store import Store
from roundtable.store.runs import Runs
from roundtable.store.schema import CapabilitySnapshotRow
from roundtable.tools.registry import ToolRegistry
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
        kept = CapabilitySnapshot.model_validate(await h.store.kept_snapshot(digest))
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


async def test_runs_sharing_a_snapshot_keep_one_row(store: Store) -> None:
    digest = snapshot_digest(SNAPSHOT)
    body = SNAPSHOT.model_dump(mode="json")
    first, second = await new_run(store), await new_run(store)
    await store.pin_snapshot(first["id"], digest, status="running", body=body)
    await store.pin_snapshot(second["id"], digest, status="running", body=body)
    # A second store on the same database (another worker) knows nothing of
    # the first's writes and inserts again: still one row.
    another = Runs(store.db, store.sessions, store.actions, store.leases)
    await another.pin_snapshot(second["id"], digest, body=body)
    async with store.db.reader() as session:
        rows = (await session.execute(CapabilitySnapshotRow.__table__.select())).all()
    assert [row.digest for row in rows] == [digest]
    assert await store.kept_snapshot(digest) == body
    assert await store.kept_snapshot("0" * 64) is None


async def test_a_turn_reads_the_snapshot_once_per_worker(
    store: Store, turns: RunActivities
) -> None:
    run = await new_run(store)
    digest = snapshot_digest(SNAPSHOT)
    await store.pin_snapshot(run["id"], digest, body=SNAPSHOT.model_dump(mode="json"))
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
    digest = snapshot_digest(SNAPSHOT)
    await store.pin_snapshot(run["id"], digest, body=SNAPSHOT.model_dump(mode="json"))
    # Someone widens seat-1's grant in the row behind the digest's back.
    widened = SNAPSHOT.model_copy(
        update={"agents": [SeatGrant(agent_id="seat-1", tools=["look", "peek"])]}
    )
    async with store.db.transaction() as session:
        await session.execute(
            update(CapabilitySnapshotRow)
            .where(CapabilitySnapshotRow.digest == digest)
            .values(body=widened.model_dump(mode="json"))
        )
    with pytest.raises(ApplicationError) as refused:
        await own_run(run["id"]).run(turns.take_turn, seat_turn(run["id"], digest))
    assert refused.value.type == SNAPSHOT_NOT_KEPT and refused.value.non_retryable
    assert "not the one it names" in str(refused.value)


async def test_a_turn_that_carries_its_specs_is_given_them(
    store: Store, turns: RunActivities
) -> None:
    """Runs opened before snapshots were kept (their recorded turns carry specs)."""
    run = await new_run(store)
    carried = seat_turn(run["id"], "unused").model_copy(
        update={"tools_of": None, "tools": [spec("peek")]}
    )
    assert await turns._tools(carried) == [spec("peek")]
