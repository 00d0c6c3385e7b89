"""A tool's spec is what a run's snapshot, and so its digest, is made of: the
schema built once per arguments model must say what pydantic says, and no
caller may change what the next run is given."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic_core import to_jsonable_python

from roundtable.tools.registry import ToolDefinition


class _Args(BaseModel):
    ticket_id: str = Field(min_length=1, max_length=128)
    priority: int = Field(default=3, ge=1, le=5)
    ceiling: float = Field(default=1e16, le=1e16)
    labels: list[str] = Field(default_factory=list)


async def _handler(args: Any, ctx: Any) -> dict[str, Any]:
    return {}


def _tool(name: str, **given: Any) -> ToolDefinition:
    """A write tool over ``_Args``, or over what ``given`` says instead."""
    facts: dict[str, Any] = {"side_effect": "write", "risk_level": "R2", "args_model": _Args}
    return ToolDefinition(name=name, description="test", handler=_handler, **{**facts, **given})


def test_the_spec_gives_the_arguments_models_own_schema() -> None:
    assert _tool("a").spec().parameters == _Args.model_json_schema()
    # Whole floats stay floats, as the snapshot's digest takes them.
    assert isinstance(_tool("a").spec().parameters["properties"]["ceiling"]["maximum"], float)


def test_a_spec_changed_by_its_caller_leaves_the_next_one_as_it_was() -> None:
    tool = _tool("a")
    first = tool.spec()
    first.parameters["properties"]["ticket_id"]["maxLength"] = 1
    first.parameters["required"].append("labels")
    again = tool.spec()
    assert again.parameters == _Args.model_json_schema()
    # Another tool over the same model is given its own copy too.
    assert _tool("b").spec().parameters is not again.parameters


def test_a_tool_described_by_its_schema_gives_each_spec_a_copy_of_its_own() -> None:
    """Found in review: an MCP tool's spec shared the tool's own schema, so a
    caller changing a spec changed the next run's and the tool's argument
    checks."""
    schema = {"type": "object", "properties": {"q": {"type": "string", "maxLength": 5}}}
    tool = _tool("mcp", side_effect="read", risk_level="R0", args_model=None, input_schema=schema)
    first = tool.spec()
    first.parameters["properties"]["q"]["maxLength"] = 1
    assert tool.spec().parameters == schema
    assert schema["properties"]["q"]["maxLength"] == 5
    assert tool.normalize({"q": "four"}) == {"q": "four"}


def test_a_schema_value_json_cannot_write_is_written_as_pydantic_writes_it() -> None:
    """Found in review: a model's json_schema_extra may put in a value JSON
    cannot write (a Decimal), which the release before carried through to
    the snapshot's JSON form; the spec must not fail on it."""

    def extra(schema: dict[str, Any]) -> None:
        schema["x-limit"] = Decimal("1.5")

    class Extra(BaseModel):
        model_config = ConfigDict(json_schema_extra=extra)
        ticket_id: str

    tool = _tool("extra", args_model=Extra)
    assert tool.spec().parameters["x-limit"] == to_jsonable_python(Decimal("1.5"))
