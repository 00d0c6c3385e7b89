"""The tool registry and the capability snapshot a run is pinned to."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ValidationError

from roundtable.models import CapabilitySnapshot, RiskLevel, SeatGrant, SideEffect, ToolSpec


@dataclass(frozen=True)
class ToolContext:
    """What a tool learns about the call. Writes get the idempotency key and
    fencing token so the system they touch can refuse duplicates and stale writers."""

    run_id: str
    seat: str
    action_id: str | None = None
    idempotency_key: str | None = None
    fencing_token: int | None = None


class ToolDefiniteFailure(Exception):
    """Raised by a tool that guarantees nothing happened: the action is
    ``failed``, not ``unknown``. Any other exception means "maybe"."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class ToolArgumentsError(ValueError):
    """The arguments do not fit the tool's schema; nothing was attempted."""


ToolHandler = Callable[[Any, ToolContext], Awaitable[dict[str, Any]]]


@dataclass(frozen=True)
class ToolDefinition:
    name: str
    description: str
    args_model: type[BaseModel]
    side_effect: SideEffect
    risk_level: RiskLevel
    handler: ToolHandler
    target_key_fields: tuple[str, ...] = ()
    target_key_namespace: str | None = None
    safe_argument_fields: tuple[str, ...] = ()

    def spec(self) -> ToolSpec:
        return ToolSpec(
            name=self.name,
            description=self.description,
            side_effect=self.side_effect,
            risk_level=self.risk_level,
            target_key_fields=list(self.target_key_fields),
            target_key_namespace=self.target_key_namespace,
            safe_argument_fields=list(self.safe_argument_fields),
            parameters=self.args_model.model_json_schema(),
        )

    def parse(self, arguments: dict[str, Any]) -> BaseModel:
        try:
            return self.args_model.model_validate(arguments)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in err['loc']) or '(arguments)'}: {err['msg']}"
                for err in exc.errors()
            )
            raise ToolArgumentsError(f"invalid arguments for {self.name}: {problems}") from exc


@dataclass
class ToolRegistry:
    tools: dict[str, ToolDefinition] = field(default_factory=dict)

    def register(self, tool: ToolDefinition) -> None:
        if tool.name in self.tools:
            raise ValueError(f"tool {tool.name!r} is already registered")
        self.tools[tool.name] = tool

    def get(self, name: str) -> ToolDefinition | None:
        return self.tools.get(name)

    def snapshot(
        self,
        seats: Iterable[str],
        tools: Iterable[str] | None = None,
        seat_tools: Mapping[str, Iterable[str]] | None = None,
    ) -> CapabilitySnapshot:
        """Pin the run to today's tools. By default every seat may use every
        tool; ``tools`` narrows the run's grant, ``seat_tools`` a seat's. Naming
        a tool that does not exist is an error, not a silent omission."""
        names = list(self.tools) if tools is None else list(tools)
        per_seat = {seat: list(granted) for seat, granted in (seat_tools or {}).items()}
        named = {*names, *(t for granted in per_seat.values() for t in granted)}
        missing = sorted(n for n in named if n not in self.tools)
        if missing:
            raise ValueError(f"unknown tools: {', '.join(missing)}")
        specs = [self.tools[n].spec() for n in self.tools if n in named]
        return CapabilitySnapshot(
            tools=specs,
            agents=[SeatGrant(agent_id=seat, tools=per_seat.get(seat, names)) for seat in seats],
        )
