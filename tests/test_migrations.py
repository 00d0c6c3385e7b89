"""Migrations build the schema; the models must agree with them."""

from __future__ import annotations

import json
import subprocess
import sys

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from roundtable.store.schema import Base


def head_revision() -> str:
    from alembic.script import ScriptDirectory

    from roundtable.store.migrate import alembic_config

    return ScriptDirectory.from_config(alembic_config()).get_current_head()


def _diff(connection) -> list:  # type: ignore[no-untyped-def]
    context = MigrationContext.configure(connection)
    return compare_metadata(context, Base.metadata)


async def test_migrated_schema_matches_the_models(store) -> None:
    async with store.engine.connect() as connection:
        differences = await connection.run_sync(_diff)
    assert differences == []


def test_cli_db_upgrade_is_idempotent(tmp_path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'cli.db'}"
    for _ in range(2):
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "roundtable.cli",
                "db",
                "upgrade",
                "--database-url",
                url,
                "--json",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout) == {"revision": head_revision()}


def test_cli_db_upgrade_reports_bad_urls(tmp_path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "roundtable.cli",
            "db",
            "upgrade",
            "--database-url",
            "mysql://nowhere/x",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2  # a malformed option is a usage error
    assert json.loads(done.stdout)["error"]["code"] == "usage"
    unreachable = subprocess.run(
        [
            sys.executable,
            "-m",
            "roundtable.cli",
            "db",
            "upgrade",
            "--database-url",
            "postgresql+asyncpg://nobody@127.0.0.1:1/none",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert unreachable.returncode == 1
    assert "cannot migrate" in unreachable.stderr
    assert "Traceback" not in unreachable.stderr
