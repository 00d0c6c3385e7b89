"""``roundtable start`` and ``roundtable show``."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError

from roundtable import operations
from roundtable.agents.scripted import ScriptError, load_script
from roundtable.cli.output import CliError, emit, fail, run_or_fail, table, usage_error
from roundtable.cli.shared import JsonFlag, settings, store_from, temporal
from roundtable.models import RunInput, RunResult
from roundtable.permissions import Authority
from roundtable.views import run_view


def build_request(**fields: Any) -> RunInput:
    try:
        return RunInput(**{k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'input'}: {e['msg']}" for e in exc.errors()
        )
        raise usage_error(problems) from exc


async def start_run(request: RunInput, wait: bool) -> dict[str, Any]:
    config = settings()
    authority = Authority.from_settings(config)
    request = authority.admit("operator", request)  # refused before connecting
    client = await temporal(config)
    async with store_from(config) as store:
        # The CLI acts with database access, as an operator would.
        started, _ = await operations.start_run(
            client,
            store,
            request,
            config.task_queue,
            authority=authority,
            role="operator",
        )
    if wait:
        handle = client.get_workflow_handle(started["run_id"], result_type=RunResult)
        result = await handle.result()
        started.update(status=result.status, final_answer=result.final_answer)
    return started


def start(
    task: Annotated[str, typer.Option("--task", help="What the roundtable should do.")],
    seats: Annotated[str, typer.Option(help="Comma-separated seat ids.")] = "seat-1,seat-2",
    manager: Annotated[str, typer.Option(help="Manager name; 'none' for no manager.")] = "manager",
    rounds: Annotated[int, typer.Option(help="Rounds to play.")] = 1,
    mode: Annotated[str, typer.Option(help="structured or parallel.")] = "structured",
    policy: Annotated[str, typer.Option(help="Write policy.")] = "confirm_all_writes",
    script: Annotated[Path | None, typer.Option(help="Scripted-model file (JSON/YAML).")] = None,
    approval_timeout: Annotated[int, typer.Option(help="Seconds an approval stays open.")] = 3600,
    tools: Annotated[str | None, typer.Option(help="Comma-separated tools to grant.")] = None,
    user: Annotated[str, typer.Option(help="The run's owner.")] = "local-user",
    model: Annotated[str, typer.Option(help="Model for every seat.")] = "scripted",
    heartbeat_timeout: Annotated[
        int | None,
        typer.Option(help="Seconds without a heartbeat before a write is presumed lost."),
    ] = None,
    lease_seconds: Annotated[int | None, typer.Option(help="Target lease length, seconds.")] = None,
    wait: Annotated[bool, typer.Option("--wait", help="Wait until the run finishes.")] = False,
    as_json: JsonFlag = False,
) -> None:
    """Start a run."""
    try:
        document = load_script(script) if script else None
        request = build_request(
            task_text=task,
            seats=[s.strip() for s in seats.split(",") if s.strip()],
            manager=None if manager.lower() == "none" else manager,
            max_rounds=rounds,
            mode=mode,
            write_policy=policy,
            script=document,
            approval_timeout_seconds=approval_timeout,
            tools=[t.strip() for t in tools.split(",")] if tools else None,
            user_id=user,
            model=model,
            heartbeat_timeout_seconds=heartbeat_timeout,
            lease_seconds=lease_seconds,
        )
        started = asyncio.run(start_run(request, wait))
    except ScriptError as exc:
        fail(usage_error(str(exc)), as_json)
    except Exception as exc:
        fail(exc, as_json)
    human = f"started run {started['run_id']}"
    if wait:
        human += f"\nstatus: {started['status']}\nfinal answer: {started['final_answer']}"
    emit(started, as_json, human)


async def _run_view(run_id: str) -> dict[str, Any]:
    async with store_from(settings()) as store:
        view = await run_view(store, run_id)
    view["final_answer"] = await _final_answer(run_id, view["status"])
    return view


async def _final_answer(run_id: str, status: str) -> str | None:
    if status != "completed":
        return None
    try:
        client = await temporal(settings())
        result = await asyncio.wait_for(
            client.get_workflow_handle(run_id, result_type=RunResult).result(), 5
        )
        return result.final_answer
    except (CliError, Exception):
        return None  # the store is the record; the answer is a convenience


def show(run_id: Annotated[str, typer.Argument(help="Run id.")], as_json: JsonFlag = False) -> None:
    """Show a run with its actions and approvals."""
    view = run_or_fail(_run_view(run_id), as_json)
    human = "\n".join(
        [
            f"run {view['run_id']}  status {view['status']}  user {view['user_id']}",
            *(
                [f"failure: {view['failure']['code']}: {view['failure']['message']}"]
                if view["failure"]
                else []
            ),
            "",
            "actions:",
            table(
                view["actions"],
                ["id", "agent_id", "tool_name", "status", "risk_level", "arguments"],
            ),
            "",
            "approvals:",
            table(view["approvals"], ["id", "action_id", "status", "expires_at", "decided_by"]),
        ]
        + ([f"\nfinal answer: {view['final_answer']}"] if view["final_answer"] else [])
    )
    emit(view, as_json, human)
