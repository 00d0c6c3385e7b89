"""A tool's spec is what a run's snapshot, and so its digest, is made of: the
schema built once per arguments model must say what pydantic says, and no
caller may change what the next run is given."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from roundtable.tools.registry import ToolDefinition


class _Args(BaseModel):
    ticket_id: str = Field(min_length=1, max_length=128)
    priority: int = Field(default=3, ge=1, le=5)
    ceiling: float = Field(default=1e16, le=1e16)
    labels: list[str] = Field(default_factory=list)


async def _handler(args: Any, ctx: Any) -> dict[str, Any]:
    return {}


def _tool(name: str) -> ToolDefinition:
    return ToolDefinition(
        name=name,
        description="test",
        side_effect="write",
        risk_level="R2",
        handler=_handler,
        args_model=_Args,
    )


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
