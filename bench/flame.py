"""Where a worker's time goes, from py-spy's collapsed stacks (`make bench
PROFILE=DIR`): each sample is put in the first category its stack matches,
idle samples (the event loop waiting, a database or pool thread waiting for
work) left out; and each kind of thread's CPU from /proc, which the samples
cannot show (SQLite and the SDK's Rust core run without the GIL).

    .venv/bin/python -m bench.flame DIR/approvals-ours.txt [more files]
"""

from __future__ import annotations

import concurrent.futures.thread
import inspect
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import aiosqlite.core

# (category, any of these in the stack), first match wins. A store call
# runs in a task of its own (completion.py), so its stack shows the store,
# not the activity that made it; and since SQLite's calls run on the event
# loop while the connection's thread is idle (sqlite_driver.py), many of
# them show no SQLAlchemy or aiosqlite frame at all.
CATEGORIES = (
    # First: it stands in for a customer's system, which bare's writes pay
    # an equivalent of, and it sends through the store's SQLite driver too.
    ("the demo ticket system", ("tools/tickets.py",)),
    ("database: SQLite's thread (aiosqlite, the statement itself)", ("_connection_worker_thread",)),
    (
        "database: the store, SQLAlchemy and the driver, on the event loop",
        ("sqlalchemy/", "aiosqlite/", "roundtable/store/", "roundtable/completion.py"),
    ),
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
)
# The driver's functions that call into SQLite: a sample whose innermost
# frame is one of them is SQLite at work (its statement, its commit), on
# the event loop; py-spy shows no frame below Python's.
SQLITE_CALLS = (
    "OneTripConnection._steps_from (",
    "OneTripCursor._run (",
    "OneTripConnection._open (",
    "OneTripConnection._ended (",
)
SQLITE_ON_THE_LOOP = "database: SQLite's statements, on the event loop"
IDLE = "EpollSelector.select"


def _blocking_get(module: Any, function: str, call: str) -> str:
    """How py-spy names the frame of a thread blocked on its queue (``call``
    inside ``function``): ``function (path:line)``. py-spy counts such a
    thread as busy, and the database's threads (one per aiosqlite
    connection) and the thread pools spend most of their time there: the
    first profiles put a third of the worker's time in "SQLite's thread",
    which per-thread CPU time showed was mostly this wait."""
    lines, first = inspect.getsourcelines(getattr(module, function))
    offset = next(i for i, text in enumerate(lines) if call in text)
    # py-spy names files from their package down: aiosqlite/core.py.
    path = module.__name__.replace(".", "/") + ".py"
    return f"{function} ({path}:{first + offset})"


WAITS = (
    _blocking_get(aiosqlite.core, "_connection_worker_thread", "tx.get()"),
    _blocking_get(concurrent.futures.thread, "_worker", "work_queue.get(block=True)"),
)


def summary(paths: list[Path]) -> list[tuple[str, float]]:
    counts: Counter[str] = Counter()
    for path in paths:
        for line in path.read_text().splitlines():
            stack, _, number = line.rpartition(" ")
            if not stack or not number.isdigit():
                continue
            leaf = stack.rsplit(";", 1)[-1]
            if IDLE in leaf or leaf in WAITS:
                continue
            name = next((c for c, marks in CATEGORIES if any(m in stack for m in marks)), "other")
            if name.startswith("database: the store") and leaf.startswith(SQLITE_CALLS):
                name = SQLITE_ON_THE_LOOP
            counts[name] += int(number)
    busy = sum(counts.values()) or 1
    return [(name, 100 * n / busy) for name, n in counts.most_common()]


def busy_samples(paths: list[Path]) -> int:
    """Samples counted in :func:`summary` (at ``make bench``'s 200 a second)."""
    total = 0
    for path in paths:
        for line in path.read_text().splitlines():
            stack, _, number = line.rpartition(" ")
            leaf = stack.rsplit(";", 1)[-1]
            if stack and number.isdigit() and IDLE not in leaf and leaf not in WAITS:
                total += int(number)
    return total


def thread_seconds(paths: list[Path]) -> dict[str, float]:
    """CPU seconds by kind of thread, from the ``-threads.txt`` files
    ``sampled`` writes beside the stacks (missing ones are skipped)."""
    spent: Counter[str] = Counter()
    for path in paths:
        threads = path.with_name(path.stem + "-threads.txt")
        if not threads.exists():
            continue
        for line in threads.read_text().splitlines():
            kind, _, seconds = line.rpartition("\t")
            if kind:
                spent[kind] += float(seconds)
    return dict(spent)


def main() -> None:
    paths = [Path(p) for p in sys.argv[1:] if not p.endswith("-threads.txt")]
    print("Python, by the thread holding the GIL:")
    for name, share in summary(paths):
        print(f"{share:5.1f}%  {name}")
    print(f"busy samples: {busy_samples(paths)}")
    spent = thread_seconds(paths)
    if spent:
        total = sum(spent.values()) or 1.0
        print("CPU by thread (/proc):")
        for kind, seconds in sorted(spent.items(), key=lambda item: -item[1]):
            print(f"{100 * seconds / total:5.1f}%  {kind} ({seconds:.1f} s)")


if __name__ == "__main__":
    main()
