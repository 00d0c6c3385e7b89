"""How `roundtable dev` starts its Temporal server when a port is taken.

`temporal server start-dev` chooses its HTTP API, metrics and internal ports
itself and binds them a moment later; once in CI another process took one
in between, and the stack failed on a race the person had no part in. The
real server is made to lose such a race here by a wrapper that hands it a
held port as its own choice of HTTP API port (the last `--http-port` wins)."""

from __future__ import annotations

import socket
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from roundtable.cli import stack as stack_module
from roundtable.cli.output import CliError
from roundtable.config import Settings
from roundtable.ports import free_port

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
        f'echo start >> "{tmp_path}/starts"\n'
        f'if [ "$(wc -l < "{tmp_path}/starts")" -le {losing_starts} ]; then\n'
        f'  exec "{REAL_TEMPORAL}" "$@" --http-port {held}\n'
        "fi\n"
        f'exec "{REAL_TEMPORAL}" "$@"\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


def starts(tmp_path: Path) -> int:
    return len((tmp_path / "starts").read_text().splitlines())


async def start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, binary: Path, port: int):  # type: ignore[no-untyped-def]
    monkeypatch.setattr(stack_module, "_temporal_binary", lambda: str(binary))
    state = tmp_path / "state"
    state.mkdir(exist_ok=True)
    settings = Settings(temporal_address=f"127.0.0.1:{port}")
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
    with pytest.raises(CliError, match=rf"could not bind port {held_port}, which it chose"):
        await start(tmp_path, monkeypatch, binary, free_port())
    assert starts(tmp_path) == losing


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
    binary.write_text(f'#!/bin/bash\necho start >> "{tmp_path}/starts"\necho "no" >&2\nexit 3\n')
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    with pytest.raises(CliError, match=r"temporal server exited \(3\)"):
        await start(tmp_path, monkeypatch, binary, free_port())
    assert starts(tmp_path) == 1
