"""Where a worker's time goes, from py-spy's collapsed stacks (`make bench
PROFILE=DIR`): each sample is put in the first category its stack matches,
idle samples (the event loop waiting) left out.

    .venv/bin/python -m bench.flame DIR/approvals-ours.txt [more files]
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

# (category, any of these in the stack), first match wins.
CATEGORIES = (
    ("database: SQLite's thread (aiosqlite, the statement itself)", ("_connection_worker_thread",)),
    ("database: SQLAlchemy and the driver, on the event loop", ("sqlalchemy/", "aiosqlite/")),
    ("workflow: a new run's sandbox (imports, class set-up)", ("_create_workflow_instance",)),
    ("payloads: conversion, encryption, visiting", ("_visitor.py", "codec", "converter")),
    (
        "workflow: activations (our workflow code and the SDK's)",
        ("_handle_activation", "_RunningWorkflow.activate", "_run_code"),
    ),
    (
        "hand-offs: other threads waking the event loop (a result per statement)",
        ("call_soon_threadsafe", "_write_to_self", "_read_from_self"),
    ),
    ("activities: the SDK's dispatch and our code", ("_activity.py", "activities/")),
    ("the demo ticket system", ("tools/tickets.py",)),
)
IDLE = "EpollSelector.select"


def summary(paths: list[Path]) -> list[tuple[str, float]]:
    counts: Counter[str] = Counter()
    for path in paths:
        for line in path.read_text().splitlines():
            stack, _, number = line.rpartition(" ")
            if not stack or not number.isdigit():
                continue
            leaf = stack.rsplit(";", 1)[-1]
            if IDLE in leaf:
                continue
            name = next((c for c, marks in CATEGORIES if any(m in stack for m in marks)), "other")
            counts[name] += int(number)
    busy = sum(counts.values()) or 1
    return [(name, 100 * n / busy) for name, n in counts.most_common()]


def main() -> None:
    for name, share in summary([Path(p) for p in sys.argv[1:]]):
        print(f"{share:5.1f}%  {name}")


if __name__ == "__main__":
    main()
