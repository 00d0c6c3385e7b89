"""``roundtable start``, ``show`` and ``runs``: directly or through the API."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError

from roundtable.agents.scripted import ScriptError, load_script
from roundtable.cli.endpoint import ApiToken, ApiTokenFile, ApiUrl
from roundtable.cli.hints import command, ended, news
from roundtable.cli.operator import Operator, ask, operator
from roundtable.cli.output import (
    EXIT_ERROR,
    CliError,
    as_cli_error,
    emit,
    fail,
    run_or_fail,
    table,
    usage_error,
)
from roundtable.cli.shared import JsonFlag
from roundtable.models import RunInput

WAIT_POLL_SECONDS = 0.5
WAIT_RETRIES = 3  # a poll of the run that fails is tried again this many times ...
WAIT_RETRY_SECONDS = 1.0  # ... this long apart
LASTING = {"unauthorized", "forbidden", "usage", "no_database", "schema_out_of_date"}


def build_request(*, manager: str = "manager", **fields: Any) -> RunInput:
    """A run request from options; an option left out (None) keeps the
    model's default and stays unset, so the API applies its own (the owner,
    the model). The manager is always set: "none" means no manager, not the
    default one. Only what was given is set: validation fills in what it
    derives (an empty script for the scripted model), and that stays unset,
    so a request through the API carries only what was asked."""
    chosen = {k: v for k, v in fields.items() if v is not None}
    try:
        request = RunInput(manager=None if manager.lower() == "none" else manager, **chosen)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'input'}: {e['msg']}" for e in exc.errors()
        )
        raise usage_error(problems) from exc
    return RunInput.model_construct(_fields_set={"manager", *chosen}, **dict(request))


def checked_idempotency_key(key: str | None) -> str | None:
    """A key as an HTTP header carries it, and the API takes it (255 characters)."""
    if key is not None and not _KEY.fullmatch(key):
        raise usage_error("--idempotency-key: 1 to 255 printable ASCII characters, without spaces")
    return key


_KEY = re.compile(r"[\x21-\x7e]{1,255}")


async def wait_for_end(ops: Operator, run_id: str, say: Callable[[str], None]) -> dict[str, Any]:
    """Follow a run to its end, telling each approval (and unknown outcome)
    it waits for with the command that decides it (and, once, what those
    commands need to work: a token, a directory)."""
    told: set[str] = set()
    note = ops.via_note
    while True:
        view = await _view(ops, run_id)
        for line in news(view, told, ops.via):
            if note:
                say(f"({note})")
                note = None
            say(line)
        if ended(view):
            return view
        await asyncio.sleep(WAIT_POLL_SECONDS)


async def _view(ops: Operator, run_id: str) -> dict[str, Any]:
    """The run's view; a failure that may pass (no answer, a server's error,
    a proxy's bad gateway) is tried again a few times before it counts."""
    for attempt in range(WAIT_RETRIES + 1):
        try:
            return await ops.run(run_id)
        except Exception as exc:
            problem = as_cli_error(exc)
            lasting = problem.exit_code != EXIT_ERROR or problem.code in LASTING
            if lasting or attempt == WAIT_RETRIES:
                raise
            await asyncio.sleep(WAIT_RETRY_SECONDS)
    raise AssertionError("unreachable")  # the loop returns or raises


def lost_sight(error: Exception, run_id: str, ops: Operator) -> CliError:
    """Following a started run failed: the error names the run (``run_id``
    in --json's error document), so that it is not taken for one never started."""
    problem = as_cli_error(error)
    again = command("show", run_id, via=ops.via)
    note = f" ({ops.via_note})" if ops.via_note else ""
    return CliError(
        f"run {run_id} was started, but waiting for it failed: {problem} "
        f"(the run goes on; see it with: {again}{note})",
        problem.code,
        problem.exit_code,
        **{**problem.fields, "run_id": run_id},
    )


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
    user: Annotated[
        str | None,
        typer.Option(help="The run's owner (default: local-user; through the API, the token's)."),
    ] = None,
    model: Annotated[
        str | None,
        typer.Option(
            help="Model for every seat (default: the server's ROUNDTABLE_DEFAULT_MODEL, "
            "else scripted)."
        ),
    ] = None,
    heartbeat_timeout: Annotated[
        int | None,
        typer.Option(help="Seconds without a heartbeat before a write is presumed lost."),
    ] = None,
    lease_seconds: Annotated[int | None, typer.Option(help="Target lease length, seconds.")] = None,
    wait: Annotated[
        bool,
        typer.Option(
            "--wait",
            help="Wait until the run ends, telling each approval it waits for "
            "(on stderr with --json) with the command to decide it.",
        ),
    ] = False,
    idempotency_key: Annotated[
        str | None,
        typer.Option(
            "--idempotency-key",
            metavar="KEY",
            help="Start the run only if no start with KEY did (the same command again "
            "answers with that run). Through the API every start carries one (a new one "
            "unless given); a start whose answer was lost names it, to retry with.",
        ),
    ] = None,
    api: ApiUrl = None,
    token: ApiToken = None,
    token_file: ApiTokenFile = None,
    as_json: JsonFlag = False,
) -> None:
    """Start a run."""
    try:
        checked_idempotency_key(idempotency_key)
        request = build_request(
            task_text=task,
            manager=manager,
            seats=[s.strip() for s in seats.split(",") if s.strip()],
            max_rounds=rounds,
            mode=mode,
            write_policy=policy,
            script=load_script(script) if script else None,
            approval_timeout_seconds=approval_timeout,
            tools=[t.strip() for t in tools.split(",")] if tools else None,
            user_id=user,
            model=model,
            heartbeat_timeout_seconds=heartbeat_timeout,
            lease_seconds=lease_seconds,
        )
    except ScriptError as exc:
        fail(usage_error(str(exc)), as_json)
    except Exception as exc:
        fail(exc, as_json)

    def say(text: str) -> None:
        # With --json, stdout keeps its one document: progress goes to stderr.
        typer.echo(text, err=as_json)

    async def go() -> dict[str, Any]:
        async with operator(api, token, token_file) as ops:
            started = await ops.start(request, idempotency_key)
            if not wait:
                return started
            run_id = started["run_id"]
            say(f"started run {run_id}")
            try:
                view = await wait_for_end(ops, run_id, lambda text: say(f"\n{text}"))
                answer = await ops.final_answer(run_id) if view["status"] == "completed" else None
            except Exception as exc:
                raise lost_sight(exc, run_id, ops) from exc
            return {**started, "status": view["status"], "final_answer": answer}

    started = run_or_fail(go(), as_json)
    human = f"started run {started['run_id']}"
    if wait:
        human = f"\nrun {started['run_id']} {started['status']}"
        if started["final_answer"] is not None:
            human += f"\nfinal answer: {started['final_answer']}"
    emit(started, as_json, human)


def show(
    run_id: Annotated[str, typer.Argument(help="Run id.")],
    api: ApiUrl = None,
    token: ApiToken = None,
    token_file: ApiTokenFile = None,
    as_json: JsonFlag = False,
) -> None:
    """Show a run with its actions and approvals."""

    async def read() -> dict[str, Any]:
        async with operator(api, token, token_file) as ops:
            view = await ops.run(run_id)
            done = view["status"] == "completed"
            view["final_answer"] = await ops.final_answer(run_id) if done else None
            return view

    view = run_or_fail(read(), as_json)
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


def list_runs(
    status: Annotated[
        str | None,
        typer.Option(
            help="Only runs in this status: pending, running, waiting_input, stalled, "
            "completed, failed, cancelled or terminated."
        ),
    ] = None,
    user: Annotated[str | None, typer.Option("--user", help="Only this user's runs.")] = None,
    limit: Annotated[int, typer.Option(min=1, help="At most this many.")] = 50,
    api: ApiUrl = None,
    token: ApiToken = None,
    token_file: ApiTokenFile = None,
    as_json: JsonFlag = False,
) -> None:
    """List runs, oldest first."""

    rows = ask((api, token, token_file), lambda ops: ops.runs(status, user, limit), as_json)
    emit(rows, as_json, table(rows, ["run_id", "user_id", "status", "created_at", "updated_at"]))
