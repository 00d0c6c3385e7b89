"""Migrations build the schema; the models must agree with them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import text

from roundtable.store import open_store
from roundtable.store.errors import SchemaNewerError
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


async def test_a_database_a_newer_release_migrated_is_named_as_such(store) -> None:
    """A worker of the release before, restarted during a rolling deploy or a
    rollback, met Alembic's "Can't locate revision": it now says what that
    means, and changes nothing."""
    async with store.engine.begin() as connection:
        await connection.execute(text("UPDATE alembic_version SET version_num = '9999'"))
    for migrate in (True, False):
        with pytest.raises(SchemaNewerError, match="newer than this Roundtable knows"):
            async with open_store(
                store.engine.url.render_as_string(hide_password=False), migrate=migrate
            ):
                pass
    async with store.engine.connect() as connection:
        assert (
            await connection.execute(text("SELECT version_num FROM alembic_version"))
        ).scalar() == "9999"
