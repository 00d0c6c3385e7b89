"""How `roundtable dev` starts its Temporal server when a port is taken, and
how the test suite starts its own.

`temporal server start-dev` chooses its HTTP API, metrics and internal ports
itself and binds them a moment later; once in CI another process took one
in between, and the stack failed on a race the person had no part in. The
real server is made to lose such a race here by a wrapper that hands it a
held port as its own choice of HTTP API port (the last `--http-port` wins)."""

from __future__ import annotations

import asyncio
import socket
import stat
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from roundtable.cli import stack as stack_module
from roundtable.cli.output import CliError
from roundtable.config import Settings
from roundtable.ports import free_port
from tests.processes import running
from tests.temporal_servers import DEV_SERVER_STARTS, start_dev_server

REAL_TEMPORAL = stack_module._temporal_binary()


@pytest.fixture
def held_port() -> Iterator[int]:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        yield held.getsockname()[1]


def wrapper(tmp_path: Path, held: int, losing_starts: int) -> Path:
    """A `temporal` whose first ``losing_starts`` server starts are handed
    ``held`` as their HTTP API port; each start is counted in `starts`."""
    script = tmp_path / "temporal"
    script.write_text(
        "#!/bin/bash\n"
        f'echo $$ >> "{tmp_path}/starts"\n'
        f'if [ "$(wc -l < "{tmp_path}/starts")" -le {losing_starts} ]; then\n'
        f'  exec "{REAL_TEMPORAL}" "$@" --http-port {held}\n'
        "fi\n"
        f'exec "{REAL_TEMPORAL}" "$@"\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


def started(tmp_path: Path) -> list[int]:
    """The process of each server start (the wrapper execs the server); a
    wrapper stopped before it wrote is no start."""
    record = tmp_path / "starts"
    return [int(pid) for pid in record.read_text().split()] if record.exists() else []


def starts(tmp_path: Path) -> int:
    return len(started(tmp_path))


async def start(  # type: ignore[no-untyped-def]
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, binary: Path, port: int, **settings: Any
):
    monkeypatch.setattr(stack_module, "_temporal_binary", lambda: str(binary))
    state = tmp_path / "state"
    state.mkdir(exist_ok=True)
    settings = Settings(temporal_address=f"127.0.0.1:{port}", **settings)
    codec = f"http://127.0.0.1:{free_port()}/codec/ui"
    return await stack_module._start_server(settings, port, free_port(), codec, state)


async def test_a_port_race_the_server_lost_is_started_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, held_port: int, capsys: pytest.CaptureFixture
) -> None:
    server = await start(tmp_path, monkeypatch, wrapper(tmp_path, held_port, 1), free_port())
    try:
        assert server.poll() is None
        assert starts(tmp_path) == 2
        log = (tmp_path / "state" / "temporal.log").read_text()
        assert f"{held_port}: bind: address already in use" in log  # the race was real
        said = capsys.readouterr().err
        assert f"temporal server lost port {held_port}" in said and "starting it again" in said
    finally:
        stack_module._stop_server(server)


async def test_a_race_lost_every_time_stops_with_the_port_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, held_port: int
) -> None:
    losing = stack_module.SERVER_START_ATTEMPTS
    binary = wrapper(tmp_path, held_port, losing_starts=losing)
    ports = ", ".join([str(held_port)] * losing)
    with pytest.raises(CliError, match=rf"on each of {losing} starts \(ports {ports}\)"):
        await start(tmp_path, monkeypatch, binary, free_port())
    assert starts(tmp_path) == losing
    assert not any(running(pid) for pid in started(tmp_path))


async def test_a_start_cancelled_stops_its_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, held_port: int
) -> None:
    """Cancelled while the server comes up (a second start, here), it once
    left that server running: nothing held it yet to stop it."""
    binary = wrapper(tmp_path, held_port, losing_starts=1)
    starting = asyncio.create_task(start(tmp_path, monkeypatch, binary, free_port()))
    # Polled: another process (the wrapper) writes it.
    while starts(tmp_path) < 2:  # noqa: ASYNC110
        await asyncio.sleep(0.05)
    starting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await starting
    assert not any(running(pid) for pid in started(tmp_path))


async def test_settings_no_server_can_satisfy_stop_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once retried for a minute, then blamed on the server ("did not come up")."""
    binary = wrapper(tmp_path, 0, losing_starts=0)
    key_file = tmp_path / "key"
    key_file.write_text("k")
    with pytest.raises(CliError, match="both ROUNDTABLE_TEMPORAL_API_KEY and"):
        await start(
            tmp_path,
            monkeypatch,
            binary,
            free_port(),
            temporal_api_key="k",
            temporal_api_key_file=str(key_file),
        )
    # The server may be stopped before its wrapper even wrote down its start.
    assert starts(tmp_path) <= 1 and not any(running(pid) for pid in started(tmp_path))


async def test_a_port_we_asked_for_is_named_with_its_holder_and_not_retried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, held_port: int
) -> None:
    """`dev` checks its ports before it starts; one taken in between is the
    person's to free, not a race to retry."""
    binary = wrapper(tmp_path, held_port, losing_starts=0)
    with pytest.raises(CliError, match=rf"port {held_port} is held by pid \d+"):
        await start(tmp_path, monkeypatch, binary, held_port)
    assert starts(tmp_path) == 1


async def test_a_server_that_exits_for_another_reason_is_not_retried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    binary = tmp_path / "temporal"
    binary.write_text(f'#!/bin/bash\necho $$ >> "{tmp_path}/starts"\necho "no" >&2\nexit 3\n')
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    with pytest.raises(CliError, match=r"temporal server exited \(3\)"):
        await start(tmp_path, monkeypatch, binary, free_port())
    assert starts(tmp_path) == 1


async def test_the_suites_own_dev_server_is_started_again_after_a_lost_race(
    tmp_path: Path, held_port: int, capfd: pytest.CaptureFixture
) -> None:
    """The tests' servers come from the SDK's ``start_local``, which runs the
    same CLI and so can lose the same race; it only waits out its startup
    wait for a server that exited, so the suite's start tries again."""
    binary = wrapper(tmp_path, held_port, losing_starts=1)
    env = await start_dev_server(binary=str(binary), startup_wait=timedelta(seconds=10))
    try:
        assert starts(tmp_path) == 2
        assert await env.client.count_workflows() is not None  # it answers
        said = capfd.readouterr().err  # the server's own output too
        assert f"{held_port}: bind: address already in use" in said  # the race was real
        assert "did not come up (start 1 of 3)" in said
    finally:
        await env.shutdown()
    assert not any(running(pid) for pid in started(tmp_path))


async def test_the_suites_own_dev_server_lost_every_time_fails_the_test(
    tmp_path: Path, held_port: int
) -> None:
    binary = wrapper(tmp_path, held_port, losing_starts=DEV_SERVER_STARTS)
    with pytest.raises(RuntimeError, match="did not start within"):
        await start_dev_server(binary=str(binary), startup_wait=timedelta(seconds=5))
    assert starts(tmp_path) == DEV_SERVER_STARTS
    assert not any(running(pid) for pid in started(tmp_path))


async def test_the_suites_own_start_raises_other_errors_at_once(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Only a server that did not come up is started again."""
    with pytest.raises(RuntimeError) as failed:
        await start_dev_server(binary=str(tmp_path / "no-such-temporal"))
    assert "did not start within" not in str(failed.value)
    assert "did not come up" not in capsys.readouterr().err
