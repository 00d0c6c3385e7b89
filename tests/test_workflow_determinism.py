"""Workflow code stays deterministic where no sandbox looks.

The worker runs workflow code outside the SDK's sandbox
(roundtable/workflow_runner.py), and the run's helpers were passed through it
before that. So this test reads every module under workflows/ for what the
sandbox used to watch: no clock, randomness, I/O, threads or environment,
only the workflow API's own (workflow.now, workflow.uuid4, timers); and,
since one module now serves every run in the worker, no mutable state at
module or class level and no ``global`` rebinding it. (tests/test_replay.py
also replays every recorded run in the strict sandbox.)"""

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


# Values that would be one mutable object shared by every run in the worker.
MUTABLE_LITERALS = (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)
MUTABLE_CALLS = {"list", "dict", "set", "bytearray", "defaultdict", "deque", "OrderedDict"}


def _shared_mutables(path: Path, tree: ast.Module) -> list[str]:
    """Assignments of mutable values at module level or in a class body."""
    bodies = [tree.body] + [n.body for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
    found = []
    for body in bodies:
        for node in body:
            value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
            mutable = isinstance(value, MUTABLE_LITERALS) or (
                isinstance(value, ast.Call)
                and isinstance(value.func, ast.Name)
                and value.func.id in MUTABLE_CALLS
            )
            if mutable:
                found.append(f"{path.name}:{node.lineno} shares a mutable value across runs")
    return found


def _problems(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = _shared_mutables(path, tree)
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
        if isinstance(node, ast.Global):
            found.append(f"{path.name}:{node.lineno} rebinds module state")
    return found


@pytest.mark.parametrize("path", sorted(WORKFLOWS.glob("*.py")), ids=lambda p: p.name)
def test_workflow_modules_use_no_clock_randomness_or_io(path: Path) -> None:
    assert _problems(path) == []


def test_the_guard_catches_what_it_is_for(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import time\nfrom datetime import datetime\nimport random\n"
        "def f():\n    datetime.now()\n    time.sleep(1)\n    open('x')\n"
        "SEEN = {}\nCOUNT = 0\nclass W:\n    runs: list = []\n    names = set()\n"
        "def g():\n    global COUNT\n    COUNT += 1\n"
    )
    problems = _problems(bad)
    assert sum("shares a mutable value" in p for p in problems) == 3
    assert any("rebinds module state" in p for p in problems)
    assert any("imports time" in p for p in problems)
    assert any("imports random" in p for p in problems)
    assert any("datetime.now" in p for p in problems)
    assert any("calls open" in p for p in problems)
