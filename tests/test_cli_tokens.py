"""roundtable tokens: a token is shown once, listed without its secret, revocable."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

CLI = str(Path(sys.executable).parent / "roundtable")


def run(tmp_path: Path, *args: str, command: str = "tokens") -> tuple[int, object]:
    env = {**os.environ, "ROUNDTABLE_DATABASE_URL": f"sqlite+aiosqlite:///{tmp_path / 't.db'}"}
    done = subprocess.run(
        [CLI, command, *args, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=env,
    )
    return done.returncode, json.loads(done.stdout)


def test_a_command_refuses_a_database_whose_schema_is_not_current(tmp_path: Path) -> None:
    """Only `roundtable db upgrade` (and the worker, and `roundtable dev`)
    change the schema; any other command says what to run and changes nothing.
    (A database that does not exist at all is another answer: no_database,
    tests/test_cli_no_database.py.)"""
    code, missing = run(tmp_path, "list")
    assert code == 4 and missing["error"]["code"] == "no_database"
    sqlite3.connect(tmp_path / "t.db").close()  # a database with no schema yet
    code, refused = run(tmp_path, "list")
    assert code != 0 and refused["error"]["code"] == "schema_out_of_date"
    assert "roundtable db upgrade" in refused["error"]["message"]
    assert run(tmp_path, "list")[1] == refused  # still empty: nothing migrated it
    assert run(tmp_path, "upgrade", command="db")[0] == 0
    assert run(tmp_path, "list") == (0, [])


def test_create_list_revoke(tmp_path: Path) -> None:
    assert run(tmp_path, "upgrade", command="db")[0] == 0
    code, created = run(tmp_path, "create", "--user", "ops-1", "--role", "operator")
    assert code == 0 and created["token"].startswith("rt_")
    code, listed = run(tmp_path, "list")
    assert code == 0 and [t["user_id"] for t in listed] == ["ops-1"]
    assert created["token"] not in json.dumps(listed)
    assert run(tmp_path, "revoke", created["id"])[0] == 0
    code, again = run(tmp_path, "revoke", created["id"])
    assert code == 3 and again["error"]["code"] == "conflict"
    assert run(tmp_path, "revoke", "nope")[0] == 4
    code, bad = run(tmp_path, "create", "--user", "x", "--role", "root")
    assert code == 2 and "role" in bad["error"]["message"]
