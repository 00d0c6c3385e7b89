"""Workflow code stays deterministic where the sandbox no longer looks.

The run's helper modules (write_path, status, approval_clock, notifier,
timeouts) are passed through the sandbox (workflows/roundtable.py): built
once per worker instead of once per run, which is what the Temporal docs ask
of deterministic code in separate files. The sandbox's restrictions then no
longer watch their calls, so this test does: no clock, randomness, I/O,
threads or environment in any module under workflows/, only the workflow
API's own (workflow.now, workflow.uuid4, timers)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

WORKFLOWS = Path(__file__).resolve().parent.parent / "workflows"
FORBIDDEN_MODULES = {
    "time",
    "random",
    "secrets",
    "uuid",
    "os",
    "sys",
    "threading",
    "multiprocessing",
    "subprocess",
    "socket",
    "urllib",
    "http",
    "httpx",
    "requests",
    "sqlalchemy",
    "aiosqlite",
    "asyncpg",
    "logging",
    "pathlib",
    "shutil",
    "tempfile",
}
# Calls that read a clock or the environment whatever module they come from.
FORBIDDEN_CALLS = {"now", "utcnow", "today", "fromtimestamp", "getenv", "urandom", "sleep"}
ALLOWED_CALLS = {("workflow", "now"), ("workflow", "sleep")}


def _problems(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        else:
            names = []
        for name in names:
            if name.split(".")[0] in FORBIDDEN_MODULES:
                found.append(f"{path.name}:{node.lineno} imports {name}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            owner_name = owner.id if isinstance(owner, ast.Name) else None
            if node.func.attr in FORBIDDEN_CALLS and (owner_name, node.func.attr) not in (
                ALLOWED_CALLS
            ):
                found.append(f"{path.name}:{node.lineno} calls {owner_name}.{node.func.attr}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id in {"open", "input", "print", "exec", "eval"}:
                found.append(f"{path.name}:{node.lineno} calls {node.func.id}")
    return found


@pytest.mark.parametrize("path", sorted(WORKFLOWS.glob("*.py")), ids=lambda p: p.name)
def test_workflow_modules_use_no_clock_randomness_or_io(path: Path) -> None:
    assert _problems(path) == []


def test_the_guard_catches_what_it_is_for(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import time\nfrom datetime import datetime\nimport random\n"
        "def f():\n    datetime.now()\n    time.sleep(1)\n    open('x')\n"
    )
    problems = _problems(bad)
    assert any("imports time" in p for p in problems)
    assert any("imports random" in p for p in problems)
    assert any("datetime.now" in p for p in problems)
    assert any("calls open" in p for p in problems)
