"""docker-compose.yml is valid, and every command it runs works outside Docker."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml

from tests.ci import unavailable
from tests.temporal_servers import start_dev_server, venv_binary

ROOT = Path(__file__).resolve().parent.parent
CLI = str(Path(sys.executable).parent / "roundtable")
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
ONE_SHOT = {"temporal-schema", "temporal-init", "roundtable-db"}


def test_services_depend_on_what_can_satisfy_them() -> None:
    assert set(SERVICES) == {
        "postgresql",
        "temporal-schema",
        "temporal",
        "temporal-init",
        "temporal-ui",
        "roundtable-db",
        "worker-workflows",
        "worker-tools",
        "api",
        "prometheus",
        "grafana",
    }
    for name, service in SERVICES.items():
        expected = "no" if name in ONE_SHOT else "unless-stopped"
        assert service.get("restart") == expected, name
        for dependency, rule in (service.get("depends_on") or {}).items():
            assert dependency in SERVICES, (name, dependency)
            condition = rule["condition"]
            if condition == "service_healthy":
                assert "healthcheck" in SERVICES[dependency], (name, dependency)
            if condition == "service_completed_successfully":
                assert dependency in ONE_SHOT, (name, dependency)
    for name in ("postgresql", "worker-workflows", "worker-tools", "api"):
        assert "healthcheck" in SERVICES[name], name
    assert SERVICES["api"]["command"][:2] == ["roundtable", "api"]
    assert "codec" in SERVICES["temporal-ui"]["environment"]["TEMPORAL_CODEC_ENDPOINT"]


def test_every_variable_is_documented_in_env_example() -> None:
    text = (ROOT / "docker-compose.yml").read_text()
    used = set(re.findall(r"\$\{([A-Z0-9_]+)(?::-[^}]*)?\}", text))
    assert used <= _variables(ROOT / ".env.example"), used - _variables(ROOT / ".env.example")


def test_workers_split_by_role_and_only_tool_workers_hold_tool_credentials() -> None:
    workflows, tools = SERVICES["worker-workflows"], SERVICES["worker-tools"]
    assert workflows["command"] == ["roundtable", "worker", "--role", "workflows"]
    assert tools["command"] == ["roundtable", "worker", "--role", "tools"]
    # One tool queue, named alike wherever runs are started or served.
    queues = {
        name: SERVICES[name]["environment"].get("ROUNDTABLE_TOOL_TASK_QUEUE")
        for name in ("worker-workflows", "worker-tools", "api")
    }
    assert set(queues.values()) == {"roundtable-tools"}, queues
    # tools.env is read by the tool workers and no other service; every
    # credential it may hold is emptied for the workflow workers, should
    # someone put it in .env instead.
    readers = {name for name, s in SERVICES.items() if "tools.env" in _env_files(s)}
    assert readers == {"worker-tools"}
    assert _env_files(tools)[-1] == "tools.env"  # its values win over .env's
    credentials = _variables(ROOT / "tools.env.example")
    assert credentials >= {"ROUNDTABLE_MCP_CONFIG", "ROUNDTABLE_DEMO_TICKETS_URL"}
    for variable in credentials:
        assert workflows["environment"].get(variable) == "", variable
        assert variable not in tools["environment"], variable


def _env_files(service: dict) -> list[str]:
    files = service.get("env_file", [])
    return [files] if isinstance(files, str) else files


def _variables(env_file: Path) -> set[str]:
    lines = env_file.read_text().splitlines()
    return {line.split("=", 1)[0] for line in lines if line and not line.startswith("#")}


def test_the_roundtable_commands_exist() -> None:
    for name in ("roundtable-db", "worker-workflows", "worker-tools", "api"):
        command = SERVICES[name]["command"]
        subcommand = command[1:3] if command[1] == "db" else command[1:2]
        done = subprocess.run(
            [CLI, *subcommand, "--help"], capture_output=True, text=True, timeout=60, check=False
        )
        assert done.returncode == 0, (name, done.stdout, done.stderr)
    for script in ("temporal-schema.sh", "temporal-init.sh"):
        path = ROOT / "deploy" / script
        assert os.access(path, os.X_OK), path
        subprocess.run(["sh", "-n", str(path)], check=True, timeout=10)


def test_every_option_compose_gives_the_worker_exists() -> None:
    done = subprocess.run(
        [CLI, "worker", "--help"], capture_output=True, text=True, timeout=60, check=True
    )
    for name in ("worker-workflows", "worker-tools"):
        for option in (a for a in SERVICES[name]["command"] if a.startswith("--")):
            assert option in done.stdout, (name, option)


def test_compose_config_validates_where_a_compose_client_exists(tmp_path) -> None:
    """Docker does not run here, but its compose client validates the file.
    CI installs Debian's docker-compose; elsewhere a missing client is a skip."""
    client = ["docker-compose"] if shutil.which("docker-compose") else None
    if client is None:
        unavailable("docker-compose", "make test installs it")
    shutil.copy(ROOT / "docker-compose.yml", tmp_path)
    shutil.copy(ROOT / ".env.example", tmp_path / ".env")
    shutil.copy(ROOT / "tools.env.example", tmp_path / "tools.env")
    done = subprocess.run(
        [*client, "config", "-q"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr


def _run(command: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=120, check=False
    )


async def test_temporal_init_registers_search_attributes_idempotently() -> None:
    env = await start_dev_server()
    try:
        address = env.client.service_client.config.target_host
        script_env = {
            **os.environ,
            "TEMPORAL_ADDRESS": address,
            "TEMPORAL_CLI": venv_binary("temporal"),
            "TEMPORAL_INIT_TRIES": "5",
        }
        for _ in range(2):
            done = await asyncio.to_thread(
                _run, ["sh", str(ROOT / "deploy" / "temporal-init.sh")], script_env
            )
            assert done.returncode == 0, done.stdout + done.stderr
        listed = await asyncio.to_thread(
            _run,
            [
                venv_binary("temporal"),
                "operator",
                "search-attribute",
                "list",
                "--address",
                address,
                "--output",
                "json",
            ],
        )
        assert listed.returncode == 0, listed.stderr
        for name in (
            "RoundtableStatus",
            "RoundtableUserId",
            "RoundtablePendingApprovals",
            "RoundtableUnknownActions",
        ):
            assert name in listed.stdout
    finally:
        await env.shutdown()


def test_api_command_serves_health_and_reports_readiness(tmp_path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {
        **os.environ,
        "ROUNDTABLE_DATABASE_URL": f"sqlite+aiosqlite:///{tmp_path / 'a.db'}",
        "ROUNDTABLE_TEMPORAL_ADDRESS": "127.0.0.1:1",
    }
    server = subprocess.Popen(
        [CLI, "api", "--port", str(port)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        for _ in range(100):
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2)
                break
            except httpx.TransportError:
                time.sleep(0.1)
        assert health.json() == {"status": "ok"}
        ready = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=10)
        assert ready.status_code == 503
        assert json.loads(ready.text)["checks"]["database"] == "ok"
        assert ready.json()["checks"]["temporal"].startswith("unavailable")
    finally:
        server.terminate()
        server.wait(timeout=20)


def test_db_upgrade_on_postgresql(postgres_url: str) -> None:
    for _ in range(2):
        done = subprocess.run(
            [CLI, "db", "upgrade", "--database-url", postgres_url, "--json"],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, done.stdout + done.stderr
