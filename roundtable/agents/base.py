"""The adapter interface every model backend implements.

Messages and tool specs go in, text and tool calls come out. Adapters hold no
per-run state: everything a turn needs travels in the :class:`TurnRequest`,
so the take-turn activity can be retried on any worker.
"""

from __future__ import annotations

from typing import Protocol

from roundtable.models import TurnRequest, TurnResponse


class ModelAdapter(Protocol):
    async def respond(self, request: TurnRequest) -> TurnResponse: ...


class UnknownModelError(ValueError):
    code = "unknown_model"


def resolve_model(name: str) -> ModelAdapter:
    """``scripted`` (default) is built in; ``openai:<model>`` arrives with the
    OpenAI-compatible adapter."""
    from roundtable.agents.scripted import ScriptedModel

    if name == "scripted":
        return ScriptedModel()
    raise UnknownModelError(f"unknown model {name!r}; available: scripted")
