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
    """``scripted`` (deterministic, no network) or ``openai:<model-name>`` (any
    OpenAI-compatible endpoint, from OPENAI_BASE_URL / OPENAI_API_KEY)."""
    from roundtable.agents.openai_compatible import PREFIX, OpenAIChatModel
    from roundtable.agents.scripted import ScriptedModel

    if name == "scripted":
        return ScriptedModel()
    if name.startswith(PREFIX) and len(name) > len(PREFIX):
        return OpenAIChatModel()
    raise UnknownModelError(f"unknown model {name!r}; use 'scripted' or 'openai:<model-name>'")
