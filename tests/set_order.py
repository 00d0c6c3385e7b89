"""Where workflow code reads a set in its iteration order.

A set of strings (or of objects hashed by address) iterates in an order that
differs between processes: Python salts ``str`` hashes per process. A worker
that replays a run after a restart, or another worker taking it over, could
then issue the run's commands in another order and fail it as
non-deterministic. Membership, size, ``sorted()``, ``min``/``max``/``any``/
``all`` and set algebra are safe; iterating, listing, joining, unpacking or
``pop()`` are not.

Read from the source alone, so approximate on purpose: a name counts as a
set wherever it is bound to one anywhere in the scanned modules (a literal,
a comprehension, ``set()``/``frozenset()``, set algebra on sets, an
annotation ``set[...]``/``frozenset[...]``, or a call of a function or
method annotated to return one). A false alarm is fixed with ``sorted()``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable

SET_TYPES = {"set", "frozenset", "Set", "AbstractSet", "MutableSet", "FrozenSet"}
# Builtins whose result depends on the order they read their argument in.
ORDERED_READERS = {"list", "tuple", "enumerate", "iter", "next", "zip", "reversed", "map"}
ORDERED_READERS |= {"filter", "dict", "str", "sum"}
SET_OPERATORS = (ast.BitOr, ast.BitAnd, ast.Sub, ast.BitXor)
# Calls that read their argument whole: a generator over a set inside them
# shows no order (``sorted(x for x in s)``, ``any(...)``, ``set(...)``).
# (Not ``sum``, whose float total depends on the order, nor ``min``/``max``,
# whose ties go to whichever comes first.)
ORDER_BLIND = {"set", "frozenset", "sorted", "any", "all", "len"}


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
    if isinstance(annotation, ast.Subscript):
        annotation = annotation.value
    return _named(annotation) in SET_TYPES


class SetNames:
    """The names bound to sets, and the functions returning one, across
    modules (a module-level frozenset imported elsewhere is still a set)."""

    def __init__(self, trees: Iterable[ast.Module]) -> None:
        self.names: set[str] = set()
        self.functions: set[str] = set()
        trees = list(trees)
        for tree in trees:
            for node in ast.walk(tree):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    if _annotated_as_set(node.returns):
                        self.functions.add(node.name)
                elif isinstance(node, ast.AnnAssign) and _annotated_as_set(node.annotation):
                    self._bind(node.target)
                elif isinstance(node, ast.arg) and _annotated_as_set(node.annotation):
                    self.names.add(node.arg)
        # Bindings from values: repeated until nothing new (a set made from sets).
        while True:
            before = len(self.names)
            for tree in trees:
                for node in ast.walk(tree):
                    if isinstance(node, ast.Assign) and self.is_set(node.value):
                        for target in node.targets:
                            self._bind(target)
                    elif isinstance(node, ast.AnnAssign | ast.AugAssign) and (
                        node.value is not None and self.is_set(node.value)
                    ):
                        self._bind(node.target)
            if len(self.names) == before:
                return

    def _bind(self, target: ast.expr) -> None:
        name = _named(target)
        if name is not None:
            self.names.add(name)

    def is_set(self, node: ast.expr) -> bool:
        if isinstance(node, ast.Set | ast.SetComp):
            return True
        if isinstance(node, ast.Call):
            called = _named(node.func)
            return called in {"set", "frozenset"} or called in self.functions
        if isinstance(node, ast.BinOp) and isinstance(node.op, SET_OPERATORS):
            return self.is_set(node.left) or self.is_set(node.right)
        name = _named(node)
        return name is not None and name in self.names


def unordered_reads(tree: ast.Module, sets: SetNames) -> list[tuple[int, str]]:
    """(line, what) for each read of a set in its iteration order."""
    found: list[tuple[int, str]] = []
    # Reads whose order cannot show: what builds another set, or is sorted,
    # counted or tested whole.
    unseen: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.SetComp):
            unseen.update(id(generator) for generator in node.generators)
        elif isinstance(node, ast.Set):
            unseen.update(id(e) for e in node.elts if isinstance(e, ast.Starred))
        elif isinstance(node, ast.Call) and _named(node.func) in ORDER_BLIND:
            for argument in node.args:
                if isinstance(argument, ast.GeneratorExp):
                    unseen.update(id(generator) for generator in argument.generators)

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
            if isinstance(called, ast.Name) and (
                called.id in ORDERED_READERS or (called.id in {"min", "max"} and keyed)
            ):
                for argument in node.args:
                    check(argument, f"reads in order ({called.id})")
            elif isinstance(called, ast.Attribute) and called.attr == "join":
                for argument in node.args:
                    check(argument, "joins")
            elif isinstance(called, ast.Attribute) and called.attr == "pop" and not node.args:
                check(called.value, "pops from")
    return found
