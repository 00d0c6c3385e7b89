"""Every command in examples/README.md, run as written, in the order written,
against the stack its first command starts; and what the page says happens,
checked. Only the stack's ports are added, so a stack already running on the
default ports does not get in the way."""

from __future__ import annotations

import json
import re
from pathlib import Path

from tests.documented import (
    ROOT,
    Waiting,
    blocks,
    checkout_shape,
    clean_env,
    documented_stack,
    placeholders,
    sh,
)

PAGE = ROOT / "examples" / "README.md"
# What the page tells a person to give the printed reconcile command.
SETTLE = re.compile(r"for example\s+`(--outcome succeeded --note \"[^\"]+\")`")


def test_the_examples_page_runs_as_written(tmp_path: Path) -> None:
    page = blocks(PAGE)
    assert [(b.line, placeholders(b)) for b in page if placeholders(b)] == []
    assert {b.language for b in page} == {"sh"}
    (settle,) = SETTLE.findall(PAGE.read_text())
    stack_command, *commands = [b.code for b in page]
    checkout_shape(tmp_path)
    outputs = []
    with documented_stack(stack_command, tmp_path, clean_env()) as stack:
        for command in commands:
            if "--wait" in command:
                outputs.append(Waiting(command, tmp_path, stack.cli_env, settle).act())
            else:
                outputs.append(sh(command, tmp_path, stack.cli_env))
        # The worker loaded the notes server's tools (example 4 used them).
        assert any("notes__add_note" in line for line in stack.lines), "".join(stack.lines)

    triage, contention, tickets_after_2, unknown, tickets_after_3, notes = outputs
    assert "completed" in triage and "T-7 is now P1" in triage, triage
    assert contention.count("waiting for approval") == 2 and "completed" in contention
    t200 = [line.split() for line in tickets_after_2.splitlines() if " T-200 " in line]
    (first, second) = sorted(t200, key=lambda row: row[5])  # by started_at
    assert int(first[3]) < int(second[3]), tickets_after_2  # fencing tokens grow
    assert first[6] <= second[5], tickets_after_2  # one ended before the other began
    assert "outcome unknown: ticket_update" in unknown and "completed" in unknown, unknown
    assert any(" T-13 " in line for line in tickets_after_3.splitlines()), tickets_after_3
    assert "completed" in notes, notes
    saved = json.loads((tmp_path / ".roundtable" / "notes.json").read_text())
    assert saved["login-outage"] == ["Root cause: expired SSO certificate; rotated at 09:40."]
