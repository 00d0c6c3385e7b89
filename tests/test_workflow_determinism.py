"""Workflow code stays deterministic where no sandbox looks.

The worker runs workflow code outside the SDK's sandbox
(roundtable/workflow_runner.py), and the run's helpers were passed through it
before that. So this test reads every module under workflows/, and the
modules of roundtable/ that run inside a workflow, for what the sandbox
used to watch: no clock, randomness, I/O, threads or environment,
only the workflow API's own (workflow.now, workflow.uuid4, timers, and
workflow.wait over asyncio.wait); and, since one module now serves every run
in the worker, no state shared between runs: module and class values are
immutable (an allow-list of constructors), no mutable default arguments, no
caches, no ``global``, ``globals()``, class attributes rebound through an
instance or module-level objects changed in place, no ``hash()``, ``id()``
or ``__hash__`` (they differ per process), no settings read from the
environment, no relative imports (this reads absolute names), no set read
in its iteration order (it differs per process for strings and for objects
hashed by address; tests/set_order.py, which approximates from the source
and says what it does not see). (Every run a test starts, and
every recorded run, also replays in the strict sandbox: tests/test_replay.py
and tests/workflow_harness.py.)"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

from tests.module_level import run_at_import
from tests.set_order import SetNames, unordered_reads

ROOT = Path(__file__).resolve().parent.parent
# workflows/, and what of roundtable/ runs inside a workflow: the models
# (validators, defaults, methods such as the request's fingerprint), the
# context budget (a seat's transcript cut to fit), names and states. The
# activities' classes are imported only to name their methods.
SCANNED = sorted((ROOT / "workflows").glob("*.py")) + [
    ROOT / "roundtable" / f"{name}.py" for name in ("models", "context_budget", "names", "states")
]
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
    "io",
    "builtins",
    "importlib",
    "_thread",
    "concurrent",
    "timeit",
}
# Calls that read a clock or the environment whatever module they come from.
FORBIDDEN_CALLS = {"now", "utcnow", "today", "fromtimestamp", "getenv", "urandom", "sleep"}
ALLOWED_CALLS = {("workflow", "now"), ("workflow", "sleep")}


# What a module or class may hold, shared as it is by every run in the worker:
# constants, tuples, and values built by these constructors from the same
# (a mapping only behind MappingProxyType; field() gives each instance its own).
IMMUTABLE_CONSTRUCTORS = {
    "timedelta",
    "RetryPolicy",
    "MappingProxyType",
    "frozenset",
    "tuple",
    "field",
    "Field",  # pydantic: a default is copied into each instance
    "_key",  # workflows/search_attributes.py: a SearchAttributeKey
    "compile",  # re.compile: a pattern
    "ConfigDict",  # a pydantic model's settings, read as its class is made
}
# Type expressions at module level (aliases), not values.
TYPE_FORMS = {"Literal", "Annotated"}
# Methods that change a list, dict or set in place.
MUTATING_METHODS = {
    "append",
    "extend",
    "insert",
    "pop",
    "remove",
    "clear",
    "update",
    "setdefault",
    "popitem",
    "add",
    "discard",
    "sort",
    "reverse",
}
# Shared state by other routes: caches, builtins that reach module state or
# differ per process (str hash and id), and the worker's settings (environment).
CACHE_DECORATORS = {"cache", "lru_cache", "cached_property"}
FORBIDDEN_BUILTINS = {"globals", "vars", "getattr", "setattr", "hash", "id", "__import__"}
FORBIDDEN_PACKAGES = ("roundtable.config",)
# asyncio's own waits hand tasks back in set order: workflow.wait instead.
FORBIDDEN_ASYNCIO = {"wait", "as_completed"}


def _immutable(value: ast.expr | None) -> bool:
    if value is None or isinstance(value, (ast.Constant, ast.Name, ast.Attribute)):
        return True
    if isinstance(value, ast.Tuple):
        return all(_immutable(item) for item in value.elts)
    if isinstance(value, ast.BinOp):
        # frozenset - {x} is a frozenset: a set literal beside an immutable
        # operand takes that operand's type.
        left, right = value.left, value.right
        if isinstance(right, ast.Set) and not isinstance(left, ast.Set):
            return _immutable(left) and all(_immutable(v) for v in right.elts)
        return _immutable(left) and _immutable(right)
    if isinstance(value, ast.Lambda):  # a factory: a new value each call
        return True
    if isinstance(value, ast.Subscript):
        return isinstance(value.value, ast.Name) and value.value.id in TYPE_FORMS
    if isinstance(value, ast.Call):
        func = value.func
        name = getattr(func, "id", getattr(func, "attr", None))
        if name not in IMMUTABLE_CONSTRUCTORS:
            return False
        args = [*value.args, *(k.value for k in value.keywords)]
        # A literal these copy, or wrap, is reachable through them only.
        if name in {"MappingProxyType", "frozenset", "tuple"} and len(args) == 1:
            if isinstance(args[0], ast.Dict):
                return all(_immutable(v) for v in args[0].values)
            if isinstance(args[0], (ast.Set, ast.List)):
                return all(_immutable(v) for v in args[0].elts)
        return all(_immutable(arg) for arg in args)
    return False


def _shared_state(path: Path, tree: ast.Module) -> list[str]:
    """Mutable values at module or class level, mutable default arguments,
    caches, and class state rebound through an instance."""
    found = []
    classes = {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    shared = classes | _module_names(tree)
    for node in run_at_import(tree):
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        if not _immutable(value):
            found.append(f"{path.name}:{node.lineno} shares a mutable value across runs")
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            defaults = [*node.args.defaults, *node.args.kw_defaults]
            if not all(_immutable(d) for d in defaults):
                found.append(f"{path.name}:{node.lineno} has a mutable default argument")
            for decorator in getattr(node, "decorator_list", []):
                named = decorator.func if isinstance(decorator, ast.Call) else decorator
                if getattr(named, "attr", getattr(named, "id", None)) in CACHE_DECORATORS:
                    found.append(f"{path.name}:{node.lineno} caches across runs")
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, (ast.AugAssign, ast.AnnAssign))
            else []
        )
        for target in targets:
            if isinstance(target, ast.Attribute) and _names_a_class(target.value, classes):
                found.append(f"{path.name}:{node.lineno} rebinds class state")
            elif isinstance(target, (ast.Attribute, ast.Subscript)) and _root(target) in shared:
                found.append(f"{path.name}:{node.lineno} changes shared state in place")
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in MUTATING_METHODS
            and _root(node.func.value) in shared - {"workflow"}  # workflow.update: a decorator
        ):
            found.append(f"{path.name}:{node.lineno} changes shared state in place")
    return found


def _module_names(tree: ast.Module) -> set[str]:
    """Names bound at module level: imported, assigned, defined."""
    names = set()
    for node in run_at_import(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
    return names


def _root(node: ast.expr) -> str | None:
    """The name an attribute or subscript chain starts from."""
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _names_a_class(node: ast.expr, classes: set[str]) -> bool:
    """``type(x)``, ``x.__class__``, ``cls`` or a class of this module."""
    if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "type":
        return True
    if isinstance(node, ast.Attribute) and node.attr == "__class__":
        return True
    return isinstance(node, ast.Name) and (node.id == "cls" or node.id in classes)


def _imported(node: ast.AST) -> list[str]:
    """What an import brings in, as dotted names: ``from a import b`` is
    ``a`` and ``a.b`` (b may be a module, or a function such as asyncio's wait)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        module = "." * node.level + (node.module or "")
        return [module, *(f"{module}.{alias.name}" for alias in node.names)]
    return []


def _aliases(tree: ast.Module) -> dict[str, str]:
    """``import asyncio as aio``: aio means asyncio."""
    return {
        alias.asname: alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
        if alias.asname
    }


# Where a set may come from besides: the activities' input and result models.
SET_SOURCES = SCANNED + sorted((ROOT / "activities").glob("*.py"))


@cache
def _shared_trees() -> tuple[ast.Module, ...]:
    return tuple(ast.parse(p.read_text(), filename=str(p)) for p in SET_SOURCES)


def _problems(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = _shared_state(path, tree)
    # A set bound in one module (states' frozensets, a result model's field)
    # and read in another.
    sets = SetNames(tree, _shared_trees())
    found += [f"{path.name}:{line} {what}" for line, what in unordered_reads(tree, sets)]
    aliases = _aliases(tree)
    for node in ast.walk(tree):
        for name in _imported(node):
            if (
                name.split(".")[0] in FORBIDDEN_MODULES
                or name.startswith(FORBIDDEN_PACKAGES)
                or name.startswith(".")
                or name in {f"asyncio.{n}" for n in FORBIDDEN_ASYNCIO}
            ):
                found.append(f"{path.name}:{node.lineno} imports {name}")
        # Referred to, called or not: ``CLOCK = datetime.now`` reads it later.
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            owner = node.value.id if isinstance(node.value, ast.Name) else None
            owner = aliases.get(owner, owner)
            if node.attr in FORBIDDEN_CALLS and (owner, node.attr) not in ALLOWED_CALLS:
                found.append(f"{path.name}:{node.lineno} uses {owner}.{node.attr}")
            if owner == "asyncio" and node.attr in FORBIDDEN_ASYNCIO:
                found.append(f"{path.name}:{node.lineno} uses asyncio.{node.attr}")
            if node.attr == "__hash__":
                found.append(f"{path.name}:{node.lineno} uses __hash__")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            called = node.func.id
            on_self = bool(node.args) and getattr(node.args[0], "id", None) == "self"
            if called in {"open", "input", "print", "exec", "eval", *FORBIDDEN_BUILTINS} and not (
                called == "getattr" and on_self  # a field of its own, by name
            ):
                found.append(f"{path.name}:{node.lineno} calls {called}")
        if isinstance(node, ast.Global):
            found.append(f"{path.name}:{node.lineno} rebinds module state")
        if isinstance(node, ast.Compare) and _by_identity(node):
            found.append(f"{path.name}:{node.lineno} compares by identity")
    return found


def _singleton(side: ast.expr) -> bool:
    """None, True, False, or a member of a class named in capitals (an
    enum's, ``Wake.DEADLINE``): one object in every process."""
    if isinstance(side, ast.Constant):
        return True
    return (
        isinstance(side, ast.Attribute)
        and isinstance(side.value, ast.Name)
        and side.value.id[:1].isupper()
    )


def _by_identity(node: ast.Compare) -> bool:
    """``is`` between two values that are not singletons: whether two runs'
    objects are one object is not theirs to see (they may share one,
    roundtable/shared_snapshots.py, or not, after a replay)."""
    sides = [node.left, *node.comparators]
    return any(
        isinstance(op, ast.Is | ast.IsNot) and not (_singleton(left) or _singleton(right))
        for op, left, right in zip(node.ops, sides[:-1], sides[1:], strict=True)
    )


@pytest.mark.parametrize("path", SCANNED, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_workflow_modules_use_no_clock_randomness_or_io(path: Path) -> None:
    assert _problems(path) == []


def test_the_shared_snapshot_table_is_the_only_state_workflow_code_shares() -> None:
    """roundtable/shared_snapshots.py runs inside workflows on purpose with
    one table shared between runs (docs/architecture.md says why that is
    safe). Read as the workflow modules are, its weak table and the table's
    one store are all it may hold: anything else added to it fails here."""
    problems = _problems(ROOT / "roundtable" / "shared_snapshots.py")
    assert sorted(problem.split(" ", 1)[1] for problem in problems) == [
        "changes shared state in place",
        "shares a mutable value across runs",
    ], problems
    source = (ROOT / "roundtable" / "shared_snapshots.py").read_text()
    assert source.count("= weakref.WeakValueDictionary()") == 1
    assert source.count("_by_digest[digest] = snapshot") == 1


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


# Each line gets past a guard that reads only plain top-level assignments and
# calls (a review of the unsandboxed worker wrote these); each must be found.
SUBTLER = {
    "with workflow.unsafe.imports_passed_through():\n    SEEN = {}": "mutable value",
    "if True:\n    RUNS = []": "mutable value",
    "ORDER = sorted({'b', 'a'})": "mutable value",
    "TALLY = Counter()": "mutable value",
    "STATE = SimpleNamespace(n=0)": "mutable value",
    "LOCK = asyncio.Lock()": "mutable value",
    "POLICY = RetryPolicy(non_retryable_error_types=['x'])": "mutable value",
    "CLOCK = datetime.now": "uses datetime.now",
    "def f():\n    getattr(datetime, 'now')()": "calls getattr",
    "async def f(tasks):\n    await asyncio.wait(tasks)": "uses asyncio.wait",
    "def f():\n    globals()['SEEN'] = 1": "calls globals",
    "def f():\n    return hash('x')": "calls hash",
    "class Board:\n    def bump(self):\n        type(self).started += 1": "rebinds class state",
    "class Board:\n    def bump(self):\n        Board.started = 1": "rebinds class state",
    "def remember(key, seen=[]):\n    return seen": "mutable default argument",
    "@lru_cache(maxsize=None)\ndef lookup(key):\n    return key": "caches across runs",
    "def f(a, b):\n    return a.snapshot is b.snapshot": "compares by identity",
    "def f(a, b):\n    return a is not b": "compares by identity",
    "from roundtable.config import load_settings": "imports roundtable.config",
    # A second review's: aliases, in-place changes, other modules' clocks and I/O.
    "from roundtable import config": "imports roundtable.config",
    "from asyncio import wait": "imports asyncio.wait",
    "import asyncio as aio\nasync def f(t):\n    await aio.wait(t)": "uses asyncio.wait",
    "from .timeouts import ONCE": "imports .timeouts",
    "from timeouts import ONCE\ndef f():\n    ONCE.maximum_attempts = 3": "in place",
    "from names import SEARCH_ATTRIBUTES\ndef f():\n    SEARCH_ATTRIBUTES['x'] = 1": "in place",
    "from notifier import Notifier\ndef f():\n    Notifier.sent = 1": "in place",
    "def f():\n    pass\ndef g():\n    f.memo = {}": "in place",
    "from names import SEEN\ndef f(x):\n    SEEN.add(x)": "in place",
    "import builtins\ndef f():\n    builtins.open('x')": "imports builtins",
    "import io": "imports io",
    "import importlib": "imports importlib",
    "import _thread": "imports _thread",
    "from concurrent.futures import ThreadPoolExecutor": "imports concurrent",
    "import timeit": "imports timeit",
    "def f(s):\n    return s.__hash__()": "uses __hash__",
    # Sets read in their iteration order, which differs per process.
    "def f(ids):\n    for i in set(ids):\n        pass": "iterates a set",
    "def f():\n    return [s for s in {'a', 'b'}]": "iterates a set",
    "from states import FINAL_RUN_STATUSES\ndef f():\n    return list(FINAL_RUN_STATUSES)": (
        "reads in order (list) a set"
    ),
    "class W:\n    def __init__(self):\n        self.seen: set[str] = set()\n"
    "    def f(self):\n        return ', '.join(self.seen)": "reads in order (join) a set",
    "def f(a, b):\n    return next(iter(set(a) - set(b)))": "reads in order (iter) a set",
    "def f(names: frozenset[str]):\n    first, *rest = names": "unpacks a set",
    "def f(s):\n    left = {x for x in s}\n    return left.pop()": "pops from a set",
    "def ids(xs) -> set[str]:\n    return set(xs)\ndef f(xs):\n    return [*ids(xs)]": (
        "unpacks a set"
    ),
    "def f(s):\n    return {k: 1 for k in set(s)}": "iterates a set",
    "def f(s):\n    return min(set(s), key=len)": "reads in order (min) a set",
    "def f(s):\n    return sum(x for x in set(s))": "iterates a set",
    # A review's: annotations wrapped, set methods, key views, more readers.
    "class R:\n    ids: set[str] | None = None\n    def f(self):\n        return list(self.ids)": (
        "reads in order (list) a set"
    ),
    "class R:\n    ids: Optional[frozenset[str]] = None\n    def f(self):\n"
    "        for i in self.ids:\n            pass": "iterates a set",
    "def f(a, b):\n    for x in a.keys() - b.keys():\n        pass": "iterates a set",
    "def f(a, b):\n    return list(set(a).union(b))": "reads in order (list) a set",
    "def f(a, lines):\n    lines.extend(set(a))": "reads in order (extend) a set",
    "def f(a):\n    return sorted(set(a), key=len)": "reads in order (sorted) a set",
    "def f(a):\n    return list(itertools.chain(set(a)))": "reads in order (chain) a set",
    "class R:\n    @property\n    def open_ids(self) -> set[str]:\n        return set()\n"
    "    def f(self):\n        return [*self.open_ids]": "unpacks a set",
}


@pytest.mark.parametrize("source", SUBTLER)
def test_the_guard_catches_shared_state_by_other_routes(tmp_path: Path, source: str) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(source + "\n")
    problems = _problems(bad)
    assert any(SUBTLER[source] in p for p in problems), problems


def test_the_guard_lets_immutable_shared_values_pass(tmp_path: Path) -> None:
    fine = tmp_path / "fine.py"
    fine.write_text(
        "LIMIT = timedelta(seconds=1)\nNAMES = ('a', 'b')\nKINDS = frozenset({'a'})\n"
        "BY_KIND = MappingProxyType({'a': 1})\n"
        "POLICY = RetryPolicy(maximum_attempts=1, non_retryable_error_types=('x',))\n"
        "def f(flag=False, limit=LIMIT):\n    return workflow.now()\n"
        "def g(ids, wanted):\n    seen = set(ids)\n"
        "    return wanted in seen, len(seen), sorted(seen), seen - {'a'},"
        " {x for x in seen}, any(x for x in seen), {*seen, 'b'}, min(seen),"
        " sorted(map(str, seen)), frozenset(map(str.lower, seen))\n"
        # Named as a set is elsewhere (a function's local in write_path.py):
        # a list here.
        "def h(waiting: list[str], known):\n    return [w for w in waiting], list(known)\n"
        # Identity with a singleton: None, a constant, an enum's member.
        "def k(a, wake):\n    return a is None, a is not True, wake is Wake.DEADLINE\n"
    )
    assert _problems(fine) == []
