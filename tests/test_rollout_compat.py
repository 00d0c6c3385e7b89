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

from roundtable.models import CapabilitySnapshot, EnsureRunInput, EnsureRunOutput, Model
from roundtable.temporal import SharedAdapterPayloadConverter

OPENED = {"run_id": "r", "session_id": "s", "snapshot": CapabilitySnapshot(tools=[], agents=[])}
OPENING = {"run_id": "r", "user_id": "u", "task_text": "t", "seats": ["seat-1"]}
# (model, the field added for runs under rules-as-of-2026-12, a value it carries)
ADDED = [
    (EnsureRunOutput, OPENED, "run_status", "running"),
    (EnsureRunInput, OPENING, "open_as", "running"),
]


def _before(model: type[Model], field: str) -> type[Model]:
    """The model as the release before had it: the same, without ``field``."""
    fields: dict[str, Any] = {
        name: (info.annotation, info) for name, info in model.model_fields.items() if name != field
    }
    return create_model(f"Old{model.__name__}", __base__=Model, **fields)


def _through_a_payload(value: Model, reader: type[Model]) -> Model:
    converter = SharedAdapterPayloadConverter()
    (payload,) = converter.to_payloads([value])
    (read,) = converter.from_payloads([payload], type_hints=[reader])
    return read


@pytest.mark.parametrize(("model", "fields", "added", "value"), ADDED)
def test_the_release_before_reads_it_while_the_field_says_nothing(
    model: type[Model], fields: dict, added: str, value: str
) -> None:
    read = _through_a_payload(model(**fields), _before(model, added))
    assert read.model_dump() == model(**fields).model_dump(exclude={added})


@pytest.mark.parametrize(("model", "fields", "added", "value"), ADDED)
def test_this_release_reads_the_field_when_it_is_set_and_the_old_form_without_it(
    model: type[Model], fields: dict, added: str, value: str
) -> None:
    assert getattr(_through_a_payload(model(**fields, **{added: value}), model), added) == value
    old = _before(model, added)(**fields)
    assert getattr(_through_a_payload(old, model), added) is None


def test_the_check_can_fail() -> None:
    """A model without the omission is what review found: the old reader refuses."""
    loud = create_model("Loud", __base__=Model, run_id=(str, ...), extra=(str | None, None))
    with pytest.raises(Exception, match="Extra inputs are not permitted"):
        _through_a_payload(loud(run_id="r"), _before(loud, "extra"))
