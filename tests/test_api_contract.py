"""Schemathesis against the real API over real HTTP, on SQLite and PostgreSQL:
no 5xx, and every answer matches the OpenAPI document (all checks).

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
# Not yet clean, so excluded for now (issue 9 §3, item 8 follow-up): the
# request schemas are looser than the validation behind them (opaque cursors,
# the codec's protobuf parsing, RunInput's cross-field rules), and Starlette's
# Allow header on OPTIONS names only the first matching route's methods.
# Every other check runs: no 5xx, response bodies, status codes and content
# types as documented, headers, authentication.
NOT_YET = "positive_data_acceptance,negative_data_rejection,allow_header_conformance"
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
        command = [
            str(Path(sys.executable).parent / "schemathesis"),
            "run",
            f"{base}/openapi.json",
            "--header",
            f"Authorization: Bearer {api.tokens['ops']}",
            "--checks",
            "all",
            "--exclude-checks",
            NOT_YET,
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
            *command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
        )
        output, _ = await process.communicate()
    report = output.decode(errors="replace")
    assert process.returncode == 0, report[-15000:]
