"""Where workflow code reads a set in its iteration order.

A set of strings (or of objects hashed by address) iterates in an order that
differs between processes: Python salts ``str`` hashes per process. A worker
that replays a run after a restart, or another worker taking it over, could
then issue the run's commands in another order: replay fails the run as
non-deterministic, or, where the reordered commands are of one activity
type, pairs recorded results with the wrong element without a word.
Membership, size, plain ``sorted()``, ``any``/``all`` over plain values and
set algebra are safe; iterating, listing, joining, extending, unpacking,
``pop()``, ``sum``, and ``sorted``/``min``/``max`` with a key (ties keep set
order) are not.

Read from the source alone, so approximate on purpose. A name counts as a
set where it is bound to one: a literal, a comprehension, ``set()``/
``frozenset()``, set algebra (operators, ``union``/``difference``/… and
``copy()`` of a set, dict key views combined by operators), an annotation
naming a set (also inside ``| None``, ``Optional``, ``Annotated``,
``ClassVar``), or a call of a function or property annotated to return one.
Names bound at module or class level (constants, model fields, including the
activities' input and result models) count everywhere; names bound inside
functions only in their own module.

Not seen (review looks for these): sets inside other containers
(``dict[str, set[str]]``, ``defaultdict(set)``), functions and parameters
without annotations, bindings by walrus or tuple assignment, a set rendered
as text by an f-string or ``repr``, and commands issued inside a generator
that an order-blind call consumes (``all(start(u) for u in urls)``).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable

from tests.module_level import run_at_import

SET_TYPES = {"set", "frozenset", "Set", "AbstractSet", "MutableSet", "FrozenSet"}
# Wrappers an annotation may put round a set type.
WRAPPERS = {"Optional", "Union", "Annotated", "ClassVar", "Final"}
SET_METHODS = {"union", "difference", "intersection", "symmetric_difference"}
# Callables whose result depends on the order they read their argument in.
ORDERED_READERS = {"list", "tuple", "enumerate", "iter", "next", "zip", "reversed", "map"}
ORDERED_READERS |= {"filter", "dict", "str", "sum", "deque", "chain", "reduce"}
ORDERED_METHODS = {"join", "extend", "fromkeys"}
KEYED = {"sorted", "min", "max"}  # with a key, ties keep the set's order
SET_OPERATORS = (ast.BitOr, ast.BitAnd, ast.Sub, ast.BitXor)
# Calls that read their argument whole: a generator over a set, or a map or
# list of one, inside them shows no order (``sorted(str(x) for x in s)``).
ORDER_BLIND = {"set", "frozenset", "sorted", "any", "all", "len"}
SHOW_NO_ORDER = {"map", "filter", "list", "tuple"}


def _named(node: ast.expr) -> str | None:
    """``x`` for ``x`` and ``self.x`` (and ``other.x``): the name a set is bound to."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _annotated_as_set(annotation: ast.expr | None) -> bool:
    if annotation is None:
        return False
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        try:
            annotation = ast.parse(annotation.value, mode="eval").body
        except SyntaxError:
            return False
    if isinstance(annotation, ast.BinOp) and isinstance(annotation.op, ast.BitOr):
        return _annotated_as_set(annotation.left) or _annotated_as_set(annotation.right)
    if isinstance(annotation, ast.Subscript):
        if _named(annotation.value) in WRAPPERS:
            inner = annotation.slice
            parts = inner.elts if isinstance(inner, ast.Tuple) else [inner]
            if _named(annotation.value) == "Annotated":
                parts = parts[:1]
            return any(_annotated_as_set(part) for part in parts)
        annotation = annotation.value
    return _named(annotation) in SET_TYPES


class SetNames:
    """The names bound to sets, and the functions returning one, as seen from
    ``home``: module- and class-level ones of every module in ``shared``,
    every one of ``home``'s own."""

    def __init__(self, home: ast.Module, shared: Iterable[ast.Module]) -> None:
        self.names: set[str] = set()
        self.functions: set[str] = set()
        shared = [tree for tree in shared if tree is not home]
        for tree in [home, *shared]:
            for node in ast.walk(tree):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    if _annotated_as_set(node.returns):
                        self.functions.add(node.name)
                        if any(
                            _named(d) in {"property", "cached_property"}
                            for d in node.decorator_list
                        ):
                            self.names.add(node.name)
        everywhere = [list(ast.walk(home))] + [run_at_import(tree) for tree in shared]
        while True:  # repeated until nothing new: a set made from sets
            before = len(self.names)
            for nodes in everywhere:
                for node in nodes:
                    self._learn(node)
            if len(self.names) == before:
                return

    def _learn(self, node: ast.AST) -> None:
        if isinstance(node, ast.AnnAssign) and (
            _annotated_as_set(node.annotation)
            or (node.value is not None and self.is_set(node.value))
        ):
            self._bind(node.target)
        elif isinstance(node, ast.Assign) and self.is_set(node.value):
            for target in node.targets:
                self._bind(target)
        elif isinstance(node, ast.AugAssign) and self.is_set(node.value):
            self._bind(node.target)
        elif isinstance(node, ast.arg) and _annotated_as_set(node.annotation):
            self.names.add(node.arg)

    def _bind(self, target: ast.expr) -> None:
        name = _named(target)
        if name is not None:
            self.names.add(name)

    def is_set(self, node: ast.expr) -> bool:
        if isinstance(node, ast.Set | ast.SetComp):
            return True
        if isinstance(node, ast.Call):
            called = _named(node.func)
            if called in {"set", "frozenset"} or called in self.functions:
                return True
            if isinstance(node.func, ast.Attribute):
                if called in SET_METHODS:
                    return True
                return called == "copy" and self.is_set(node.func.value)
            return False
        if isinstance(node, ast.BinOp) and isinstance(node.op, SET_OPERATORS):
            return any(self.is_set(side) or _a_key_view(side) for side in (node.left, node.right))
        name = _named(node)
        return name is not None and name in self.names


def _a_key_view(node: ast.expr) -> bool:
    """``d.keys()`` or ``d.items()``: combined by a set operator, a set."""
    return isinstance(node, ast.Call) and _named(node.func) in {"keys", "items"}


def _order_blind(tree: ast.Module) -> set[int]:
    """Nodes whose reading of a set shows no order: what builds another set,
    or is sorted, counted or tested whole."""
    unseen: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.SetComp):
            unseen.update(id(generator) for generator in node.generators)
        elif isinstance(node, ast.Set):
            unseen.update(id(e) for e in node.elts if isinstance(e, ast.Starred))
        elif isinstance(node, ast.Call) and _named(node.func) in ORDER_BLIND:
            if _named(node.func) == "sorted" and node.keywords:
                continue  # a key's ties keep the set's order
            for argument in node.args:
                if isinstance(argument, ast.GeneratorExp):
                    unseen.update(id(generator) for generator in argument.generators)
                elif isinstance(argument, ast.Call) and _named(argument.func) in SHOW_NO_ORDER:
                    unseen.add(id(argument))
    return unseen


def unordered_reads(tree: ast.Module, sets: SetNames) -> list[tuple[int, str]]:
    """(line, what) for each read of a set in its iteration order."""
    found: list[tuple[int, str]] = []
    unseen = _order_blind(tree)

    def check(node: ast.expr, how: str) -> None:
        if sets.is_set(node):
            found.append((node.lineno, f"{how} a set ({ast.unparse(node)})"))

    for node in ast.walk(tree):
        if id(node) in unseen:
            continue
        if isinstance(node, ast.For | ast.AsyncFor):
            check(node.iter, "iterates")
        elif isinstance(node, ast.comprehension):
            check(node.iter, "iterates")
        elif isinstance(node, ast.Starred):
            check(node.value, "unpacks")
        elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Tuple | ast.List):
            check(node.value, "unpacks")
        elif isinstance(node, ast.Call):
            called = node.func
            keyed = any(k.arg == "key" for k in node.keywords)
            name = _named(called)
            # By name, plain or qualified: ``itertools.chain``, ``functools.reduce``.
            if name in ORDERED_READERS or (name in KEYED and keyed):
                for argument in node.args:
                    check(argument, f"reads in order ({name})")
            elif isinstance(called, ast.Attribute) and name in ORDERED_METHODS:
                for argument in node.args:
                    check(argument, f"reads in order ({name})")
            elif isinstance(called, ast.Attribute) and name == "pop" and not node.args:
                check(called.value, "pops from")
    return found
