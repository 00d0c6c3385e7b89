"""The tool registry and the capability snapshot a run is pinned to."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, cast

import jsonschema
from pydantic import BaseModel, ValidationError
from pydantic_core import to_jsonable_python

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
    """A tool: its facts for the snapshot, how to check its arguments (a
    pydantic model, or a JSON Schema for tools described by others, e.g. MCP
    servers) and the handler that runs it."""

    name: str
    description: str
    side_effect: SideEffect
    risk_level: RiskLevel
    handler: ToolHandler
    args_model: type[BaseModel] | None = None
    input_schema: dict[str, Any] | None = None
    target_key_fields: tuple[str, ...] = ()
    target_key_namespace: str | None = None
    safe_argument_fields: tuple[str, ...] = ()
    # True only for a tool whose effects cannot outlive its call: once the
    # call has returned, raised or been cancelled to its end, nothing of it
    # is still under way (an in-process write, say). A remote call may go on
    # at the server after the client gave up, so by default an attempt is
    # never taken to be over before its lease has run out.
    effects_end_with_call: bool = False
    # The argument naming the tenant a write acts for, if the tool has one: a
    # run or an approver limited to some tenants may not write for another.
    tenant_field: str | None = None
    # A read Temporal may retry: running it twice must be harmless. False for
    # reads whose "read-only" is someone else's word (an MCP server's hint):
    # they run at most once.
    retry_safe: bool = True
    # How to fence the system the tool writes to: make it refuse, from now on,
    # the write of this attempt (the context's idempotency key and token) and
    # any older one to the same target; False if it shows that write already
    # applied. Reconciling an unknown write as failed does this first, so an
    # attempt frozen past its lease can never land after the operator's word.
    fence: Callable[[Any, ToolContext], Awaitable[bool]] | None = None

    def __post_init__(self) -> None:
        if (self.args_model is None) == (self.input_schema is None):
            raise ValueError(f"tool {self.name!r} needs exactly one of args_model, input_schema")

    def spec(self) -> ToolSpec:
        return ToolSpec(
            name=self.name,
            description=self.description,
            side_effect=self.side_effect,
            risk_level=self.risk_level,
            target_key_fields=list(self.target_key_fields),
            target_key_namespace=self.target_key_namespace,
            safe_argument_fields=list(self.safe_argument_fields),
            parameters=json.loads(self._parameters_text),
        )

    @cached_property
    def _parameters_text(self) -> str:
        """The JSON Schema of the tool's arguments, as JSON text, built once
        per tool: pydantic takes about 150 µs a model to build it, and every
        run's opening asks for every tool's (a few percent of a worker's CPU
        per run). Kept as text so each spec gets a copy of its own, nested
        dicts too, which no caller can change for the next spec or for the
        tool's own argument checks. Values JSON cannot write (a Decimal a
        model's ``json_schema_extra`` put there) are written as pydantic's
        JSON mode writes them, as the snapshot's digest takes them. A model
        changed after the tool's first spec (``model_rebuild``) is not seen:
        tools are built when the worker starts, as their specs are published."""
        if self.input_schema is not None:
            schema = self.input_schema
        else:  # __post_init__ saw to it that there is exactly one
            schema = cast(type[BaseModel], self.args_model).model_json_schema()
        return json.dumps(schema, default=to_jsonable_python)

    def parse(self, arguments: dict[str, Any]) -> Any:
        """The arguments as the handler takes them, or ToolArgumentsError."""
        if self.args_model is None:
            return self._check_schema(arguments)
        try:
            return self.args_model.model_validate(arguments)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in err['loc']) or '(arguments)'}: {err['msg']}"
                for err in exc.errors()
            )
            raise ToolArgumentsError(f"invalid arguments for {self.name}: {problems}") from exc

    def normalize(self, arguments: dict[str, Any]) -> dict[str, Any]:
        """Checked arguments as plain JSON: what is stored, keyed and approved."""
        parsed = self.parse(arguments)
        return parsed if isinstance(parsed, dict) else parsed.model_dump(mode="json")

    def _check_schema(self, arguments: dict[str, Any]) -> dict[str, Any]:
        if not isinstance(arguments, dict):
            raise ToolArgumentsError(f"invalid arguments for {self.name}: not an object")
        problems = sorted(
            jsonschema.Draft202012Validator(self.input_schema).iter_errors(arguments),
            key=lambda e: list(e.path),
        )
        if problems:
            detail = "; ".join(
                f"{'.'.join(str(p) for p in e.path) or '(arguments)'}: {e.message}"
                for e in problems
            )
            raise ToolArgumentsError(f"invalid arguments for {self.name}: {detail}")
        return dict(arguments)


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
        """Pin the run to today's tools (see :func:`snapshot_of`)."""
        specs = {name: tool.spec() for name, tool in self.tools.items()}
        return snapshot_of(specs, seats, tools, seat_tools)


def snapshot_of(
    specs: Mapping[str, ToolSpec],
    seats: Iterable[str],
    tools: Iterable[str] | None = None,
    seat_tools: Mapping[str, Iterable[str]] | None = None,
) -> CapabilitySnapshot:
    """A run's snapshot of the tools ``specs`` describes (the worker's own, or
    those tool workers published). By default every seat may use every tool;
    ``tools`` narrows the run's grant, ``seat_tools`` a seat's. Naming a tool
    that does not exist is an error, not a silent omission."""
    names = list(specs) if tools is None else list(tools)
    per_seat = {seat: list(granted) for seat, granted in (seat_tools or {}).items()}
    named = {*names, *(t for granted in per_seat.values() for t in granted)}
    missing = sorted(n for n in named if n not in specs)
    if missing:
        raise ValueError(f"unknown tools: {', '.join(missing)}")
    return CapabilitySnapshot(
        tools=[spec for name, spec in specs.items() if name in named],
        agents=[SeatGrant(agent_id=seat, tools=per_seat.get(seat, names)) for seat in seats],
    )
