"""Every entry point reaches Temporal through the one connection the settings
describe: over real TLS (a terminator in front of the dev server, demanding a
client certificate; tests/tls_proxy.py), and refusing, by name and before any
network call, settings that cannot work."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from temporalio.api.workflowservice.v1 import GetSystemInfoRequest
from temporalio.testing import WorkflowEnvironment

from roundtable.client import RoundtableClient
from roundtable.config import Settings
from roundtable.ports import free_port
from roundtable.temporal import connect, data_converter
from tests.conftest import TEST_SECRET
from tests.dev_stack import CLI, run_cli
from tests.e2e_stack import Stack, one_write_script
from tests.temporal_servers import start_dev_server
from tests.tls_proxy import SERVER_NAME, Pki, TlsProxy, make_pki
from workflows import search_attributes

API_KEY = "tmprl-api-key-Zq8sKx2"


@pytest.fixture
async def server() -> AsyncIterator[WorkflowEnvironment]:
    env = await start_dev_server(
        search_attributes=list(search_attributes.ALL), data_converter=data_converter()
    )
    try:
        yield env
    finally:
        await env.shutdown()


def _plain_address(env: WorkflowEnvironment) -> str:
    return env.client.service_client.config.target_host


def mtls(pki: Pki, proxy: TlsProxy, **overrides: str) -> dict[str, str]:
    """The variables of a worker on a cluster with its own CA and mTLS."""
    variables = {
        "ROUNDTABLE_TEMPORAL_ADDRESS": proxy.address,
        "ROUNDTABLE_TEMPORAL_TLS_CLIENT_CERT_PATH": str(pki.client_cert),
        "ROUNDTABLE_TEMPORAL_TLS_CLIENT_KEY_PATH": str(pki.client_key),
        "ROUNDTABLE_TEMPORAL_TLS_SERVER_CA_CERT_PATH": str(pki.ca_cert),
        "ROUNDTABLE_TEMPORAL_TLS_SERVER_NAME": SERVER_NAME,
    }
    return {**variables, **overrides}


def settings_of(variables: dict[str, str]) -> Settings:
    return Settings(
        **{k.removeprefix("ROUNDTABLE_").lower(): v for k, v in variables.items() if v != ""}
    )


async def _connects(settings: Settings) -> bool:
    try:
        client = await asyncio.wait_for(connect(settings), timeout=30)
    except (RuntimeError, TimeoutError):
        return False
    info = await client.workflow_service.get_system_info(GetSystemInfoRequest())
    return bool(info.server_version)


async def test_mtls_needs_the_certificate_the_ca_and_the_server_name(
    server: WorkflowEnvironment, tmp_path: Path
) -> None:
    pki = make_pki(tmp_path)
    with TlsProxy(_plain_address(server), pki, require_client_cert=True) as proxy:
        assert await _connects(settings_of(mtls(pki, proxy)))
        assert proxy.client_subjects == ["roundtable-worker"]
        # Each part is needed: the terminator wants the client certificate,
        # the server's certificate is signed by our CA and names only
        # temporal.test, and a plain client gets nowhere.
        without_cert = mtls(
            pki,
            proxy,
            ROUNDTABLE_TEMPORAL_TLS_CLIENT_CERT_PATH="",
            ROUNDTABLE_TEMPORAL_TLS_CLIENT_KEY_PATH="",
        )
        assert not await _connects(settings_of(without_cert))
        other_ca = mtls(
            pki, proxy, ROUNDTABLE_TEMPORAL_TLS_SERVER_CA_CERT_PATH=str(pki.other_ca_cert)
        )
        assert not await _connects(settings_of(other_ca))
        assert not await _connects(
            settings_of(mtls(pki, proxy, ROUNDTABLE_TEMPORAL_TLS_SERVER_NAME=""))
        )
        assert not await _connects(Settings(temporal_address=proxy.address))
        assert proxy.handshakes == 1


async def test_an_api_key_goes_over_tls(server: WorkflowEnvironment, tmp_path: Path) -> None:
    """The dev server checks no key; what is checked is that the key turns TLS on
    (a terminator answers nothing in clear) and that the SDK takes it."""
    pki = make_pki(tmp_path)
    key_file = tmp_path / "api-key"
    key_file.write_text(API_KEY + "\n")
    with TlsProxy(_plain_address(server), pki, require_client_cert=False) as proxy:
        settings = Settings(
            temporal_address=proxy.address,
            temporal_api_key_file=key_file,
            temporal_tls_server_ca_cert_path=pki.ca_cert,
            temporal_tls_server_name=SERVER_NAME,
        )
        client = await connect(settings)
        await client.workflow_service.get_system_info(GetSystemInfoRequest())
        assert client.service_client.config.api_key == API_KEY
        assert proxy.handshakes == 1


async def test_worker_cli_api_and_client_all_connect_over_mtls(
    server: WorkflowEnvironment, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The proxy is the only address any of them is given."""
    (tmp_path / "pki").mkdir()
    pki = make_pki(tmp_path / "pki")
    with TlsProxy(_plain_address(server), pki, require_client_cert=True) as proxy:
        stack = Stack(server, tmp_path, proxy.address)
        stack.vars.update(mtls(pki, proxy))
        code, upgraded = await asyncio.to_thread(stack.cli, "db", "upgrade")
        assert code == 0, upgraded
        worker = stack.start_worker()
        api = None
        try:
            run_script = one_write_script(tmp_path / "script.json", "T-1")
            started = await stack.start(
                "--task", "t", "--script", run_script, "--policy", "auto_approve_up_to:R3"
            )
            final = await asyncio.to_thread(
                stack.until, stack.run_with_status(started["run_id"], "completed"), "the run"
            )
            assert final["actions"][0]["status"] == "succeeded"

            port = free_port()
            api = _start_api(port, stack)
            ready = await asyncio.to_thread(
                stack.until, lambda: _ready(port), "the API to reach Temporal"
            )
            assert ready["checks"] == {"database": "ok", "temporal": "ok"}

            for name, value in mtls(pki, proxy).items():
                monkeypatch.setenv(name, value)
            typed = await RoundtableClient.connect(task_queue=stack.vars["ROUNDTABLE_TASK_QUEUE"])
            assert (await typed.state(started["run_id"])).status == "completed"
        finally:
            if api is not None:
                api.terminate()
                api.wait(timeout=20)
            assert stack.stop_workers() == [0], (tmp_path / "worker.log").read_text()[-2000:]
        assert worker.returncode == 0
        # The worker, each CLI command, the API and the typed client: each a
        # TLS connection presenting the client certificate.
        assert proxy.handshakes >= 4
        assert set(proxy.client_subjects) == {"roundtable-worker"}


def _start_api(port: int, stack: Stack) -> subprocess.Popen:  # type: ignore[type-arg]
    return subprocess.Popen(
        [CLI, "api", "--port", str(port)],
        env=stack.vars,
        cwd=stack.workdir,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _ready(port: int) -> dict | None:
    try:
        answer = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=5)
    except httpx.TransportError:
        return None
    return answer.json() if answer.status_code == 200 else None


def _env(tmp_path: Path, **variables: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROUNDTABLE_TEMPORAL_")}
    return {
        **env,
        "ROUNDTABLE_DATABASE_URL": f"sqlite+aiosqlite:///{tmp_path / 'rt.db'}",
        "ROUNDTABLE_ACTION_SECRET_KEY": TEST_SECRET,
        "ROUNDTABLE_WORKER_METRICS_ADDRESS": "",
        "ROUNDTABLE_TEMPORAL_ADDRESS": f"127.0.0.1:{free_port()}",
        **variables,
    }


def test_every_entry_point_refuses_settings_that_cannot_work(tmp_path: Path) -> None:
    """Nothing listens: the refusal comes before any connection is tried."""
    pki = make_pki(tmp_path)
    cert_only = _env(tmp_path, ROUNDTABLE_TEMPORAL_TLS_CLIENT_CERT_PATH=str(pki.client_cert))
    key_in_clear = _env(
        tmp_path, ROUNDTABLE_TEMPORAL_TLS="false", ROUNDTABLE_TEMPORAL_API_KEY=API_KEY
    )
    missing_key_file = _env(
        tmp_path, ROUNDTABLE_TEMPORAL_API_KEY_FILE=str(tmp_path / "no-such-key")
    )
    upgraded = run_cli("db", "upgrade", "--json", cwd=tmp_path, env=cert_only)
    assert upgraded.returncode == 0, upgraded.stderr

    worker = run_cli("worker", cwd=tmp_path, env=cert_only)
    assert worker.returncode == 1
    assert (
        "error: worker stopped: ROUNDTABLE_TEMPORAL_TLS_CLIENT_CERT_PATH is set without "
        "ROUNDTABLE_TEMPORAL_TLS_CLIENT_KEY_PATH"
    ) in worker.stderr, worker.stderr

    api = run_cli("api", "--port", str(free_port()), cwd=tmp_path, env=key_in_clear)
    assert api.returncode == 1
    assert "error: the API did not start: ROUNDTABLE_TEMPORAL_TLS=false" in api.stderr, api.stderr
    assert "an API key needs TLS" in api.stderr
    assert API_KEY not in api.stdout + api.stderr

    started = run_cli("start", "--task", "t", "--json", cwd=tmp_path, env=missing_key_file)
    assert started.returncode == 1
    error = json.loads(started.stdout)["error"]
    assert error["code"] == "bad_settings"
    assert error["message"] == (
        f"cannot read ROUNDTABLE_TEMPORAL_API_KEY_FILE ({tmp_path / 'no-such-key'}): "
        "No such file or directory"
    )


async def test_the_typed_client_refuses_them_too(monkeypatch: pytest.MonkeyPatch) -> None:
    from roundtable.temporal import TemporalSettingsError

    monkeypatch.setenv("ROUNDTABLE_TEMPORAL_TLS", "false")
    monkeypatch.setenv("ROUNDTABLE_TEMPORAL_API_KEY", API_KEY)
    with pytest.raises(TemporalSettingsError, match="an API key needs TLS") as raised:
        await RoundtableClient.connect(address=f"127.0.0.1:{free_port()}")
    assert API_KEY not in str(raised.value)
