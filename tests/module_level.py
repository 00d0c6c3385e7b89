"""What a module runs as it is imported, for the tests that read workflow
code from its source (tests/test_workflow_determinism.py, tests/set_order.py)."""

from __future__ import annotations

import ast


def run_at_import(tree: ast.Module) -> list[ast.stmt]:
    """Every statement a module runs as it is imported: its body, what is
    nested in with/if/try/loops there (imports_passed_through blocks), and
    class bodies."""
    todo, found = list(tree.body), []
    while todo:
        node = todo.pop(0)
        found.append(node)
        if isinstance(node, (ast.With, ast.If, ast.Try, ast.For, ast.While, ast.ClassDef)):
            for name in ("body", "orelse", "finalbody"):
                todo.extend(getattr(node, name, []))
            for handler in getattr(node, "handlers", []):
                todo.extend(handler.body)
    return found
