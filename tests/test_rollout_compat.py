"""During a rolling deploy, workers of two releases read what the other
wrote: an old run's activity may run on a new worker, and the old workflow
code reads its result. Models forbid fields they do not know, so a field
added for new runs must not be sent while it says nothing (found in review:
an old run could not read a new worker's ensure_run result, which carried
"run_status": null). Each added field here is checked against the model as
it was before the field, built by leaving it out."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import create_model

from roundtable.models import (
    CapabilitySnapshot,
    Decision,
    EnsureRunInput,
    EnsureRunOutput,
    ExtendInput,
    Model,
    ReadToolInput,
    RecordDecisionInput,
    RunState,
    TakeTurnInput,
    ToolCall,
)
from roundtable.temporal import SharedAdapterPayloadConverter

OPENED = {"run_id": "r", "session_id": "s", "snapshot": CapabilitySnapshot(tools=[], agents=[])}
OPENING = {"run_id": "r", "user_id": "u", "task_text": "t", "seats": ["seat-1"]}
EXTEND = {"approval_id": "a", "seconds": 60, "extended_by": "op-1"}
DECISION = Decision(approval_id="a", decision="approved", decided_by="op-1")
TURN = {"run_id": "r", "seat": "seat-1", "round": 1, "role": "seat", "model": "m", "task_text": "t"}
# (model, its other fields, the fields added for runs under rules-as-of-2026-12
# with a value each may carry). The release before is the model without any of
# them: the oldest release a rolling deploy of this one may meet.
ADDED = [
    (EnsureRunOutput, OPENED, {"run_status": "running", "snapshot_digest": "d" * 64}),
    (EnsureRunInput, OPENING, {"open_as": "running", "keep_snapshot": True}),
    (TakeTurnInput, TURN, {"tools_of": "d" * 64, "chain": "first-execution-run-id"}),
    (RunState, {"run_id": "r"}, {"snapshot_digest": "d" * 64}),
    (ExtendInput, EXTEND, {"request_key": "update-1"}),
    (RecordDecisionInput, {"decision": DECISION}, {"request_key": "update-1"}),
]


def _before(model: type[Model], added: set[str]) -> type[Model]:
    """The model as the release before had it: the same, without ``added``."""
    fields: dict[str, Any] = {
        name: (info.annotation, info)
        for name, info in model.model_fields.items()
        if name not in added
    }
    return create_model(f"Old{model.__name__}", __base__=Model, **fields)


def _through_a_payload(value: Model, reader: type[Model]) -> Model:
    converter = SharedAdapterPayloadConverter()
    (payload,) = converter.to_payloads([value])
    (read,) = converter.from_payloads([payload], type_hints=[reader])
    return read


@pytest.mark.parametrize(("model", "fields", "added"), ADDED)
def test_the_release_before_reads_it_while_the_fields_say_nothing(
    model: type[Model], fields: dict, added: dict[str, Any]
) -> None:
    read = _through_a_payload(model(**fields), _before(model, set(added)))
    assert read.model_dump() == model(**fields).model_dump(exclude=set(added))


@pytest.mark.parametrize(("model", "fields", "added"), ADDED)
def test_this_release_reads_the_fields_when_set_and_the_old_form_without_them(
    model: type[Model], fields: dict, added: dict[str, Any]
) -> None:
    read = _through_a_payload(model(**fields, **added), model)
    assert {name: getattr(read, name) for name in added} == added
    old = _before(model, set(added))(**fields)
    assert all(getattr(_through_a_payload(old, model), name) is None for name in added)


def test_the_check_can_fail() -> None:
    """A model without the omission is what review found: the old reader refuses."""
    loud = create_model("Loud", __base__=Model, run_id=(str, ...), extra=(str | None, None))
    with pytest.raises(Exception, match="Extra inputs are not permitted"):
        _through_a_payload(loud(run_id="r"), _before(loud, {"extra"}))


def test_the_release_before_reads_a_read_that_carries_no_snapshot() -> None:
    """Reads stopped carrying the run's snapshot (read by nothing) but still
    send the field, empty: the release before requires it."""
    call = ToolCall(id="c1", name="ticket_get", arguments={"ticket_id": "T-1"})
    sent = ReadToolInput(run_id="r", seat="seat-1", call=call)
    fields: dict[str, Any] = {
        name: (info.annotation, info) for name, info in ReadToolInput.model_fields.items()
    }
    fields["snapshot"] = (CapabilitySnapshot, ...)  # required, as it was
    before = create_model("OldReadToolInput", __base__=Model, **fields)
    read = _through_a_payload(sent, before)
    assert read.model_dump() == sent.model_dump()
    assert read.snapshot == CapabilitySnapshot(tools=[], agents=[])
