"""The README's Python examples run as written."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from tests.workflow_harness import harness

README = Path(__file__).resolve().parent.parent / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)


async def run_example(block: str) -> None:
    # The examples use top-level await, as in an async REPL.
    namespace: dict = {}
    exec(  # noqa: S102 - running our own documentation
        "async def _example():\n" + textwrap.indent(block, "    "), namespace
    )
    await namespace["_example"]()


def test_the_readme_has_both_examples() -> None:
    blocks = python_blocks()
    assert any("open_store" in b for b in blocks)
    assert any("RoundtableClient" in b for b in blocks)


async def test_store_example_runs(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (block,) = [b for b in python_blocks() if "open_store" in b]
    await run_example(block)
    assert (tmp_path / "rt.db").exists()


async def test_client_example_runs_against_a_worker(
    tmp_path, monkeypatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (block,) = [b for b in python_blocks() if "RoundtableClient" in b]
    async with harness(tmp_path) as h:
        monkeypatch.setenv(
            "ROUNDTABLE_TEMPORAL_ADDRESS", h.client.service_client.config.target_host
        )
        monkeypatch.setenv("ROUNDTABLE_TASK_QUEUE", h.task_queue)
        await run_example(block)
    assert "completed" in capsys.readouterr().out
