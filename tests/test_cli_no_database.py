"""Run from the wrong directory, a command says where it looked for the
database; it never creates an empty one there (it once did, then said the
schema was missing)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.dev_stack import run_cli


@pytest.mark.parametrize(
    "command",
    [
        ["show", "run-x"],
        ["approvals"],
        ["runs"],
        ["events", "run-x"],
        ["tickets"],
        ["check", "--no-temporal"],
    ],
)
def test_a_command_run_elsewhere_names_the_missing_database(tmp_path: Path, command) -> None:
    env = {k: v for k, v in os.environ.items() if k != "ROUNDTABLE_DATABASE_URL"}
    env["ROUNDTABLE_ACTION_SECRET_KEY"] = "a-test-secret-that-is-long-enough-1234"
    done = run_cli(*command, "--json", cwd=tmp_path, env=env)
    assert done.returncode == 4, done.stdout + done.stderr
    error = json.loads(done.stdout)["error"]
    assert error["code"] == "no_database"
    assert str(tmp_path / ".roundtable" / "roundtable.db") in error["message"]
    assert not (tmp_path / ".roundtable").exists()  # nothing made where it looked
