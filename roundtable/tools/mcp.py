"""Tools from Model Context Protocol servers, declared in the usual
``{"mcpServers": {...}}`` JSON (Claude Desktop, Cursor, VS Code), read from the
file named by ``ROUNDTABLE_MCP_CONFIG``.

Each server's tools register as ``<server>__<tool>``. Defaults come from the
tool's annotations (``readOnlyHint`` → read; ``destructiveHint`` → write R3;
otherwise write R2) and can be overridden per tool in an optional
``"roundtable"`` block of the server entry::

    {"mcpServers": {"crm": {"command": "crm-mcp",
      "roundtable": {"errors_are_definite": false,
                     "tools": {"update_contact": {"risk_level": "R1",
                       "target_key_fields": ["contact_id"],
                       "safe_argument_fields": ["contact_id"]}}}}}}

A read runs at most once (no retries: a server's ``readOnlyHint`` is its own
word, and a "read" that writes must not run twice) unless the server's block
says ``"trusted_read_only": true``. A write runs through the same approval,
lease and ``unknown`` path as any other; it receives the idempotency key and
fencing token in the call's ``_meta``. A write whose server answers with an
error is ``unknown`` unless the server declares its errors definite (MCP does
not say whether anything happened). Calls go through the worker's long-lived
sessions (``mcp_sessions``): one server process per stdio server, restarted
when it died between calls, and no request ever sent twice.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mcp import StdioServerParameters
from mcp.client.stdio import get_default_environment

from roundtable.children import dies_with_us
from roundtable.tools.mcp_sessions import MCPSessions
from roundtable.tools.registry import (
    ToolContext,
    ToolDefiniteFailure,
    ToolDefinition,
    ToolRegistry,
)

CONFIG_ENV_VAR = "ROUNDTABLE_MCP_CONFIG"
IDEMPOTENCY_META = "roundtable.dev/idempotency-key"
FENCING_META = "roundtable.dev/fencing-token"
SEPARATOR = "__"
_OVERRIDABLE = (
    "side_effect",
    "risk_level",
    "target_key_fields",
    "target_key_namespace",
    "safe_argument_fields",
    "description",
    "tenant_field",
)


class MCPConfigError(ValueError):
    code = "mcp_config_error"


class MCPToolError(RuntimeError):
    """The server answered a write with an error: it may or may not have acted."""


@dataclass(frozen=True)
class MCPServerSpec:
    name: str
    command: str | None = None
    args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    url: str | None = None
    overrides: dict[str, dict[str, Any]] = field(default_factory=dict)
    errors_are_definite: bool = False
    # Whether this server's readOnlyHint is trusted: only then are its reads
    # retried like our own. Otherwise a "read" that in truth writes could run
    # twice, so each runs at most once.
    trusted_read_only: bool = False

    def target(self) -> StdioServerParameters | str:
        if self.url:
            return self.url
        # The SDK's safe minimum (HOME, PATH, ...) and what the config gives:
        # never the worker's own environment, which holds the action secret,
        # the database URL and model keys. Killed with the worker, however
        # it dies (an orphan would keep a stateful server running).
        command, *args = dies_with_us([str(self.command), *self.args])
        return StdioServerParameters(
            command=command, args=args, env={**get_default_environment(), **self.env}
        )


def load_config(path: str | Path) -> list[MCPServerSpec]:
    try:
        document = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise MCPConfigError(f"cannot read MCP config {path}: {exc}") from exc
    servers = document.get("mcpServers") if isinstance(document, dict) else None
    if not isinstance(servers, dict):
        raise MCPConfigError(f'{path}: expected {{"mcpServers": {{...}}}}')
    specs = []
    for name, entry in servers.items():
        if SEPARATOR in name or not name:
            raise MCPConfigError(f"server name {name!r} may not be empty or contain '__'")
        if not isinstance(entry, dict) or bool(entry.get("command")) == bool(entry.get("url")):
            raise MCPConfigError(f"server {name!r} needs exactly one of command or url")
        extra = entry.get("roundtable") or {}
        specs.append(
            MCPServerSpec(
                name=name,
                command=entry.get("command"),
                args=tuple(entry.get("args") or ()),
                env=dict(entry.get("env") or {}),
                url=entry.get("url"),
                overrides=dict(extra.get("tools") or {}),
                errors_are_definite=bool(extra.get("errors_are_definite", False)),
                trusted_read_only=bool(extra.get("trusted_read_only", False)),
            )
        )
    return specs


def _facts(spec: MCPServerSpec, tool: Any) -> dict[str, Any]:
    hints = tool.annotations
    if hints is not None and hints.read_only_hint:
        facts: dict[str, Any] = {"side_effect": "read", "risk_level": "R0"}
    elif hints is not None and hints.destructive_hint:
        facts = {"side_effect": "write", "risk_level": "R3"}
    else:
        facts = {"side_effect": "write", "risk_level": "R2"}
    facts.update(
        description=tool.description or tool.name,
        target_key_fields=(),
        # Without declared key fields a write locks the whole server:
        # coarse, but never two unknown writes side by side.
        target_key_namespace=f"mcp:{spec.name}",
        safe_argument_fields=(),
    )
    for key, value in spec.overrides.get(tool.name, {}).items():
        if key not in _OVERRIDABLE:
            raise MCPConfigError(f"{spec.name}.{tool.name}: unknown override {key!r}")
        facts[key] = tuple(value) if isinstance(value, list) else value
    facts["retry_safe"] = facts["side_effect"] != "read" or spec.trusted_read_only
    return facts


async def call_tool(
    spec: MCPServerSpec,
    tool_name: str,
    side_effect: str,
    arguments: dict[str, Any],
    ctx: ToolContext,
    sessions: MCPSessions,
) -> dict[str, Any]:
    meta = (
        {IDEMPOTENCY_META: ctx.idempotency_key, FENCING_META: ctx.fencing_token}
        if side_effect == "write"
        else None
    )
    result = await sessions.call_tool(spec.name, spec.target(), tool_name, arguments, meta=meta)
    text = [getattr(block, "text", "") for block in result.content or []]
    if result.is_error:
        message = " ".join(text)[:500] or "the tool reported an error"
        if side_effect == "read" or spec.errors_are_definite:
            raise ToolDefiniteFailure("mcp_tool_error", message)
        raise MCPToolError(message)
    if result.structured_content is not None:
        return dict(result.structured_content)
    if len(text) == 1:  # many servers answer with one JSON object as text
        try:
            value = json.loads(text[0])
        except json.JSONDecodeError:
            value = None
        if isinstance(value, dict):
            return value
    return {"content": text}


async def register_mcp_tools(
    registry: ToolRegistry, specs: list[MCPServerSpec], sessions: MCPSessions
) -> list[str]:
    """Ask each server for its tools and register them; returns the names.
    The tools call through ``sessions``, which the caller closes after the
    worker has stopped (the discovery's session stays open for the calls)."""
    names = []
    for spec in specs:
        listed = await sessions.list_tools(spec.name, spec.target())
        for tool in listed:
            facts = _facts(spec, tool)

            async def handler(
                arguments: dict[str, Any],
                ctx: ToolContext,
                *,
                _spec: MCPServerSpec = spec,
                _tool: str = tool.name,
                _effect: str = facts["side_effect"],
            ) -> dict[str, Any]:
                return await call_tool(_spec, _tool, _effect, arguments, ctx, sessions)

            name = f"{spec.name}{SEPARATOR}{tool.name}"
            registry.register(
                ToolDefinition(
                    name=name,
                    handler=handler,
                    input_schema=tool.input_schema or {"type": "object"},
                    **facts,
                )
            )
            names.append(name)
    return names
