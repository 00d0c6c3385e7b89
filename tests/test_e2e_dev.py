"""`make run` (roundtable dev --demo) as a person uses it: follow the printed
commands, watch the run finish, press Ctrl-C, and find nothing left running."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import httpx

from tests.dev_stack import CLI, dev_stack, free_port, listening, run_cli, run_printed


def test_dev_demo_runs_to_completion_and_stops_cleanly(tmp_path: Path) -> None:
    with dev_stack(tmp_path) as stack:
        stack.wait_for(rf"Temporal UI: http://127\.0\.0\.1:{stack.ui_port}/")
        (token_file,) = stack.wait_for(r"operator token: in (\S+) \(readable only by you")
        token_path = tmp_path / token_file
        assert token_path.stat().st_mode & 0o077 == 0
        token = token_path.read_text().strip()
        runs = httpx.get(
            f"http://127.0.0.1:{stack.api_port}/v1/runs",
            headers={"Authorization": f"Bearer {token}"},
            timeout=10,
        )
        assert runs.status_code == 200, runs.text
        # The inbox, beside the operator token (tests/test_inbox_browser.py decides
        # the demo's approvals there in Chromium).
        (inbox, inbox_token_file) = stack.wait_for(
            r"Inbox: (http://\S+/inbox) .* \(paste the contents of (\S+)\)"
        )[0]
        assert inbox == f"http://127.0.0.1:{stack.api_port}/inbox"
        assert inbox_token_file == token_file
        assert 'name="token"' in httpx.get(f"{inbox}/login", timeout=10).text
        # The printed commands work as printed, from any directory, with
        # nothing set: once they named a database relative to the stack's.
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        anywhere = {k: v for k, v in stack.env.items() if not k.startswith("ROUNDTABLE_")}
        for command in stack.wait_for(r"approve: (.+ approve .+)", count=2):
            assert token not in command
            assert run_printed(command, elsewhere, anywhere)["status"] == "approved"
        (show,) = stack.wait_for(r"run demo-\S+ completed: (.+ show .+?)   \(Ctrl-C")
        assert run_printed(show, elsewhere, anywhere)["status"] == "completed"
        assert not (elsewhere / ".roundtable").exists()
        assert (tmp_path / ".roundtable" / "dev-secret").stat().st_mode & 0o077 == 0
        # The worker's informational lines show (plain format, one a line).
        stack.wait_for(r"INFO roundtable\.worker all worker polling")
        # The worker's metrics, where dev said: the SDK's and ours.
        (url,) = stack.wait_for(r"worker metrics: (http://\S+/metrics)")
        assert url == f"http://127.0.0.1:{stack.metrics_port}/metrics"
        scraped = httpx.get(url, timeout=10).text
        assert "temporal_workflow_completed" in scraped, scraped[:2000]
        assert re.search(r'roundtable_actions_total\{[^}]*status="succeeded"[^}]*\} [1-9]', scraped)
        assert listening(stack.port)
    assert "stack stopped" in stack.output
    ports = (stack.port, stack.ui_port, stack.api_port, stack.metrics_port)
    assert not any(listening(p) for p in ports), "a server was left running"


def test_dev_says_why_the_worker_did_not_start(tmp_path: Path) -> None:
    """Once it exited 1 printing only "stack stopped"."""
    config = tmp_path / "mcp.json"
    config.write_text('{"mcpServers": {"crm": {"command": "no-such-mcp-server-binary"}}}')
    env = {k: v for k, v in os.environ.items() if k != "ROUNDTABLE_ACTION_SECRET_KEY"}
    env["ROUNDTABLE_MCP_CONFIG"] = str(config)
    ports = [str(free_port()) for _ in range(4)]
    done = run_cli(
        "dev",
        *("--temporal-port", ports[0], "--ui-port", ports[1], "--api-port", ports[2]),
        *("--metrics-port", ports[3]),
        cwd=tmp_path,
        env=env,
        timeout=120,
    )
    assert done.returncode == 1
    said = done.stdout + done.stderr
    assert "the worker did not start" in said and "no-such-mcp-server-binary" in said, said
    assert "Traceback" not in said
    assert not listening(int(ports[0])), "the Temporal server was left running"


def _command_lines() -> list[str]:
    lines = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                lines.append((proc / "cmdline").read_bytes().replace(b"\0", b" ").decode())
            except OSError:
                continue
    return lines


def test_dev_stack_tokens_stay_off_command_lines_and_the_ui_decodes_without_one(
    tmp_path: Path,
) -> None:
    """Once the UI's codec endpoint carried the operator token: readable at the
    UI's /api/v1/settings, in the temporal process's command line and in the
    API's access log, and never revoked. Now the UI decodes through the
    loopback endpoint, which takes no token, so no token is on any command line.
    A Temporal API key left in the shell for a real cluster is dropped, unshown:
    dev runs its own plain server."""
    api_key = "tmprl-key-from-the-shell-Qx7"
    with dev_stack(
        tmp_path,
        ROUNDTABLE_TEMPORAL_API_KEY=api_key,
        ROUNDTABLE_TEMPORAL_TLS_SERVER_NAME="temporal.example",
    ) as stack:
        stack.wait_for(
            r"ignoring ROUNDTABLE_TEMPORAL_TLS_SERVER_NAME, ROUNDTABLE_TEMPORAL_API_KEY: "
            r"roundtable dev runs its own Temporal server"
        )
        (token_file,) = stack.wait_for(r"operator token: in (\S+) \(readable only by you")
        operator = (tmp_path / token_file).read_text().strip()
        ui = f"http://127.0.0.1:{stack.ui_port}"
        settings = httpx.get(f"{ui}/api/v1/settings", timeout=10)
        endpoint = settings.json()["Codec"]["Endpoint"]
        api = f"http://127.0.0.1:{stack.api_port}"
        assert endpoint == f"{api}/codec/ui", endpoint
        # The UI's page decodes (its browser sends the UI's Origin); no other
        # page does, and the endpoint reads nothing but payloads.
        decoded = httpx.post(
            f"{endpoint}/decode", json={"payloads": []}, headers={"Origin": ui}, timeout=10
        )
        assert decoded.status_code == 200, decoded.text
        evil = httpx.post(
            f"{endpoint}/decode", json={"payloads": []}, headers={"Origin": "https://evil.example"}
        )
        assert evil.status_code == 403, evil.text
        # An operator token is never taken in a URL.
        in_path = httpx.post(f"{api}/codec/t/{operator}/decode", json={"payloads": []})
        assert in_path.status_code == 403
        lines = _command_lines()
        # Any token's shape (rt_ and 43 url-safe characters), not a test
        # database's (rt_ and 16 hex digits, a PostgreSQL backend's title).
        leaked = [
            line
            for line in lines
            if operator in line or api_key in line or re.search(r"\brt_[\w-]{32}", line)
        ]
        assert leaked == []
        stack.wait_for(r"waiting for approval")
    assert operator not in stack.output and api_key not in stack.output
    assert not (tmp_path / token_file).exists()
    assert (tmp_path / ".roundtable" / "roundtable.db").stat().st_mode & 0o077 == 0
    assert (tmp_path / ".roundtable" / "temporal.db").stat().st_mode & 0o077 == 0
    listed = subprocess.run(
        [CLI, "tokens", "list", "--json"],
        cwd=tmp_path,
        env=stack.env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    dev_tokens = [t for t in json.loads(listed.stdout) if t["label"] == "roundtable dev"]
    assert len(dev_tokens) == 1 and dev_tokens[0]["revoked_at"], dev_tokens


def test_a_killed_dev_takes_its_temporal_server_with_it(tmp_path: Path) -> None:
    """SIGKILL (the OOM killer does not ask) once left the dev server running
    in its own session, holding its ports and database for the next stack."""
    from roundtable.ports import port_holder

    with dev_stack(tmp_path) as stack:
        stack.wait_for(r"Temporal UI: ")
        holder = port_holder(stack.port)
        assert holder is not None and "temporal" in holder, holder
        server_pid = int(holder.split()[1])
        stack.process.kill()
        stack.process.wait(timeout=30)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and Path(f"/proc/{server_pid}").exists():
            time.sleep(0.1)
        outlived = Path(f"/proc/{server_pid}").exists()
        if outlived:  # leave no orphan behind a failing test
            os.kill(server_pid, signal.SIGKILL)
        assert not outlived, f"the server {server_pid} outlived dev"
        assert not listening(stack.port) and not listening(stack.ui_port)


def test_dev_names_the_process_holding_its_port(tmp_path: Path) -> None:
    import socket as sockets

    with sockets.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if k != "ROUNDTABLE_ACTION_SECRET_KEY"}
        ports = ["--temporal-port", str(port), "--ui-port", str(free_port())]
        ports += ["--metrics-port", str(free_port())]
        done = run_cli("dev", *ports, "--api-port", str(free_port()), cwd=tmp_path, env=env)
    assert done.returncode != 0
    said = done.stdout + done.stderr
    assert f"port {port} (temporal) is held by pid {os.getpid()}" in said, said


def test_api_and_worker_say_why_they_cannot_start(tmp_path: Path) -> None:
    """`roundtable api` without an action secret once exited 1 printing nothing."""
    env = {k: v for k, v in os.environ.items() if k != "ROUNDTABLE_ACTION_SECRET_KEY"}
    env.pop("ROUNDTABLE_PAYLOAD_KEYS", None)
    env["ROUNDTABLE_DATABASE_URL"] = f"sqlite+aiosqlite:///{tmp_path / 'rt.db'}"
    env["ROUNDTABLE_TEMPORAL_ADDRESS"] = f"127.0.0.1:{free_port()}"
    env["ROUNDTABLE_WORKER_METRICS_ADDRESS"] = f"127.0.0.1:{free_port()}"
    for command in (["api", "--port", str(free_port())], ["worker"]):
        done = run_cli(*command, cwd=tmp_path, env=env)
        assert done.returncode != 0, command
        assert "ROUNDTABLE_ACTION_SECRET_KEY" in done.stderr, (command, done.stderr)
