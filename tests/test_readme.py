"""The README's Python examples run as written."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)


async def test_store_example_runs(tmp_path, monkeypatch) -> None:
    blocks = python_blocks()
    assert blocks, "README lost its Python example"
    monkeypatch.chdir(tmp_path)
    for block in blocks:
        # The examples use top-level await, as in an async REPL.
        namespace: dict = {}
        exec(  # noqa: S102 - running our own documentation
            "async def _example():\n" + textwrap.indent(block, "    "), namespace
        )
        await namespace["_example"]()
    assert (tmp_path / "rt.db").exists()
