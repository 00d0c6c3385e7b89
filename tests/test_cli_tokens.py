"""roundtable tokens: a token is shown once, listed without its secret, revocable."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

CLI = str(Path(sys.executable).parent / "roundtable")


def run(tmp_path: Path, *args: str) -> tuple[int, object]:
    env = {**os.environ, "ROUNDTABLE_DATABASE_URL": f"sqlite+aiosqlite:///{tmp_path / 't.db'}"}
    done = subprocess.run(
        [CLI, "tokens", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=env,
    )
    return done.returncode, json.loads(done.stdout)


def test_create_list_revoke(tmp_path: Path) -> None:
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
