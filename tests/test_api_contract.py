"""Schemathesis against the real API over real HTTP, on SQLite and PostgreSQL:
no 5xx, and every answer matches the OpenAPI document (every check).

Bounded and reproducible: a fixed seed, deterministic generation and a fixed
number of examples per operation (a few hundred requests in all)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from tests.api_server import serve_api
from tests.workflow_harness import harness

EXAMPLES_PER_OPERATION = 12
# Every check runs. One is narrowed, and only where a JSON Schema cannot say
# what the API accepts: positive_data_acceptance is off for the paged lists
# (a cursor is opaque: only one this API gave out is valid) and for starting a
# run (cross-field rules, and the server's ceilings and model allowlist).
# Bodies over the server's size limit are refused with 413, a rejection too.
CONFIG = """
[checks]
enabled = true
negative_data_rejection.expected-statuses = [
  400, 401, 403, 404, 405, 406, 409, 413, 415, 422, 428, 429,
]

[[operations]]
include-name = [
  "GET /v1/runs",
  "GET /v1/approvals",
  "GET /v1/runs/{run_id}/events",
  "GET /v1/webhook-deliveries",
  "POST /v1/runs",
]
checks.positive_data_acceptance.enabled = false
"""
SEED = 20241130


@pytest.fixture(params=["sqlite", "postgresql"])
def api_database(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite+aiosqlite:///{tmp_path / 'api.db'}"
    return request.getfixturevalue("postgres_url")


async def test_schemathesis_finds_no_5xx_and_no_schema_violation(
    tmp_path: Path, api_database: str
) -> None:
    async with harness(tmp_path, database_url=api_database) as h, serve_api(h) as api:
        base = str(api.http.base_url).rstrip("/")
        config = tmp_path / "schemathesis.toml"
        config.write_text(CONFIG)
        command = [
            str(Path(sys.executable).parent / "schemathesis"),
            "--config-file",
            str(config),
            "run",
            f"{base}/openapi.json",
            "--header",
            f"Authorization: Bearer {api.tokens['ops']}",
            "--phases",
            "examples,coverage,fuzzing",
            "--max-examples",
            str(EXAMPLES_PER_OPERATION),
            "--seed",
            str(SEED),
            "--generation-deterministic",
            "--workers",
            "1",
            "--request-timeout",
            "30",
            "--no-color",
        ]
        # The server runs in this event loop: wait for the CLI without blocking it.
        process = await asyncio.create_subprocess_exec(
            *command,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            cwd=tmp_path,  # schemathesis keeps a cache in its working directory
        )
        output, _ = await process.communicate()
    report = output.decode(errors="replace")
    assert process.returncode == 0, report[-15000:]
