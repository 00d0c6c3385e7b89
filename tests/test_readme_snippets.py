"""Every code block in README.md: none has a placeholder to guess; each JSON
block is a document the product accepts; each shell and Python block is run
here as written, or named below with the reason it is not (and where it is
covered instead). A new block that is neither fails this test."""

from __future__ import annotations

import asyncio
import json
import re
import sys
from pathlib import Path

from roundtable.models import ScriptDocument
from roundtable.tools.mcp import load_config
from tests.documented import (
    ROOT,
    Block,
    Waiting,
    blocks,
    checkout_shape,
    clean_env,
    documented_stack,
    placeholders,
    sh,
)
from tests.fake_openai import fake_openai, message

README = ROOT / "README.md"
SNIPPET = ROOT / "tests" / "run_snippet.py"
PYTHON = sys.executable

# Blocks not run here, by their first line, and why.
NOT_RUN = {
    "make run     # embedded stack (Temporal dev server + UI, worker, SQLite) and the demo run": (
        "CI runs `make test` itself; `make run` is `roundtable dev --demo`, which "
        "tests/test_e2e_dev.py runs and drives to the end"
    ),
    "cp .env.example .env      # then change every value": (
        "Docker does not run on these machines; tests/test_deploy.py validates the file "
        "with docker-compose and runs each of its commands outside Docker"
    ),
    "export ROUNDTABLE_TEMPORAL_ADDRESS=us-east-1.aws.api.temporal.io:7233": (
        "needs a Temporal Cloud namespace; tests/test_temporal_tls.py runs the worker, the "
        "CLI, the API and the client with these variables over TLS, and "
        "tests/test_temporal_settings.py checks the arguments an API key gives"
    ),
    "export ROUNDTABLE_TEMPORAL_ADDRESS=10.20.0.15:7233": (
        "names a cluster that is not here; tests/test_temporal_tls.py runs the worker, the "
        "CLI, the API and the client with these variables against a TLS terminator that "
        "demands the client certificate"
    ),
    "# Runs and the store's bookkeeping: no tool code, no tool credentials.": (
        "long-running workers: tests/test_scale_out.py runs a workflows worker and two "
        "tool workers under load; tests/test_worker_roles.py runs each role and the "
        "worker command's refusals"
    ),
    ".venv/bin/python -m bench.scale             # 1 all; 2 workflows+tools; 3 workflows+2 tools": (
        "minutes of load on a throwaway PostgreSQL cluster: `make bench` runs it, and "
        "tests/test_bench_smoke.py runs its smoke form (every point of the curve is produced)"
    ),
    "ROUNDTABLE_TEST_DATABASE_URL=postgresql+asyncpg://postgres@127.0.0.1:5432/postgres \\": (
        "this is what `make test` does, on the throwaway cluster tests/conftest.py starts"
    ),
}
# Run by the tests below, by their first line.
RUN = {
    "# The models a run may name are a setting, read where a run is started and",
    "import asyncio",
    'export ROUNDTABLE_ACTION_SECRET_KEY="$(cat .roundtable/dev-secret)"',
    ".venv/bin/roundtable db upgrade --json",
    "from datetime import UTC, datetime, timedelta",
}


def readme_blocks() -> list[Block]:
    return blocks(README)


def one(first_line: str) -> Block:
    (found,) = [b for b in readme_blocks() if b.first_line == first_line]
    return found


def test_every_block_is_complete_and_accounted_for(tmp_path: Path) -> None:
    found = readme_blocks()
    assert [(b.line, placeholders(b)) for b in found if placeholders(b)] == []
    runnable = [b for b in found if b.language in ("sh", "python")]
    unaccounted = [
        (b.line, b.first_line) for b in runnable if b.first_line not in RUN | NOT_RUN.keys()
    ]
    assert unaccounted == [], "run these in this file, or say in NOT_RUN why not"
    assert {b.first_line for b in runnable} >= RUN, "a block this file runs is gone"
    for block in (b for b in found if b.language == "json"):
        document = json.loads(block.code)
        if "mcpServers" in document:
            config = tmp_path / "mcp.json"
            config.write_text(block.code)
            assert [s.name for s in load_config(config)] == list(document["mcpServers"])
        else:
            ScriptDocument.model_validate(document)


def test_the_schema_and_store_snippets_run_as_written(tmp_path: Path) -> None:
    env = clean_env(ROUNDTABLE_ACTION_SECRET_KEY="readme-" + "x" * 32)
    checkout_shape(tmp_path)
    upgrade = one(".venv/bin/roundtable db upgrade --json")
    upgraded = sh(upgrade.code, tmp_path, env)
    assert "revision" in json.loads(upgraded)
    store = one("from datetime import UTC, datetime, timedelta")
    sh(f"{PYTHON} {SNIPPET} <<'SNIPPET'\n{store.code}SNIPPET", tmp_path, env)
    assert (tmp_path / "rt.db").exists()


async def test_the_model_and_client_snippets_run_against_a_stack(tmp_path: Path) -> None:
    """The model endpoint is the one part outside the product: a fake one,
    speaking the real wire format, stands in for Ollama's URL."""
    models = one("# The models a run may name are a setting, read where a run is started and")
    stack_part, start_part = models.code.split("# In another terminal, after the same export:\n")
    (export,) = [line for line in stack_part.splitlines() if line.startswith("export ")]
    start_part = f"{export}\n{start_part}"
    client = one("import asyncio")
    secret = one('export ROUNDTABLE_ACTION_SECRET_KEY="$(cat .roundtable/dev-secret)"')
    checkout_shape(tmp_path)

    async with fake_openai(lambda _body, _n: message("T-7 needs an owner.")) as fake:
        stack_command = stack_part.replace("http://127.0.0.1:11434/v1", fake.base_url)
        assert stack_command != stack_part, "the snippet no longer names Ollama's URL"

        def drive() -> tuple[str, str]:
            with documented_stack(stack_command, tmp_path, clean_env()) as stack:
                started = Waiting(start_part, tmp_path, stack.cli_env).act()
                env = stack.cli_env
                snippet = f"{PYTHON} {SNIPPET} <<'SNIPPET'\n{client.code}SNIPPET"
                ran = sh(f"{secret.code}{snippet}", tmp_path, env)
            return started, ran

        started, ran = await asyncio.to_thread(drive)
    assert re.search(r"run \S+ completed\nfinal answer: T-7 needs an owner\.", started), started
    assert any(r["model"] == "llama3.1" for r in fake.requests)
    assert ran.strip() == "completed T-7 is now P1.", ran


def test_the_temporal_cluster_examples_name_real_settings() -> None:
    """Not run (no cluster here), but a misspelt variable would be ignored
    silently by the process it was meant for."""
    from roundtable.config import Settings

    for first_line in (k for k in NOT_RUN if k.startswith("export ROUNDTABLE_TEMPORAL_")):
        names = re.findall(r"^export ROUNDTABLE_(\w+)=", one(first_line).code, re.MULTILINE)
        assert len(names) >= 3, first_line
        assert {n.lower() for n in names} <= set(Settings.model_fields), names
