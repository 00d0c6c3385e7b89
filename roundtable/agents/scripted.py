"""A deterministic model driven by a script document: demos and tests need no network.

A seat with no entry for a round says it has nothing to add and calls no tool.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from pydantic import ValidationError

from roundtable.models import ScriptDocument, ToolCall, TurnRequest, TurnResponse

NOTHING_TO_ADD = "I have nothing to add this round."


class ScriptError(ValueError):
    code = "invalid_script"


class ScriptedModel:
    async def respond(self, request: TurnRequest) -> TurnResponse:
        script = request.script or ScriptDocument()
        if request.role == "manager":
            return TurnResponse(text=script.final or _summary(request))
        turn = next(
            (t for t in script.turns if t.seat == request.seat and t.round == request.round), None
        )
        if turn is None:
            return TurnResponse(text=NOTHING_TO_ADD)
        calls = [
            ToolCall(
                id=call.id or f"{request.seat}-r{request.round}-c{index}",
                name=call.name,
                arguments=call.args,
            )
            for index, call in enumerate(turn.tool_calls, start=1)
        ]
        return TurnResponse(text=turn.text, tool_calls=calls)


def _summary(request: TurnRequest) -> str:
    return "No final answer was scripted for this run."


def load_script(path: str | Path) -> ScriptDocument:
    """Read a script from JSON or YAML, with errors that say what is wrong."""
    source = Path(path)
    try:
        text = source.read_text()
    except OSError as exc:
        raise ScriptError(f"cannot read script {source}: {exc.strerror}") from exc
    try:
        data = json.loads(text) if source.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ScriptError(f"script {source} is not valid JSON/YAML: {exc}") from exc
    try:
        return ScriptDocument.model_validate(data)
    except ValidationError as exc:
        raise ScriptError(f"script {source} does not fit the script format: {exc}") from exc
