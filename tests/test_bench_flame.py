"""bench.flame: what counts as a worker's busy time. A thread blocked on its
queue is idle, whatever py-spy says; the first profiles counted the database
threads' waits as a third of the worker's time."""

from __future__ import annotations

from pathlib import Path

from bench.flame import WAITS, busy_samples, summary, thread_seconds

LOOP = "<module> (roundtable/cli/main.py:1);BaseEventLoop.run_forever (asyncio/base_events.py:607)"
THREAD = "Thread._bootstrap (threading.py:995);Thread.run (threading.py:982)"


def test_idle_waits_are_left_out_and_busy_time_is_sorted(tmp_path: Path) -> None:
    aiosqlite_wait, pool_wait = WAITS
    stacks = tmp_path / "worker.txt"
    stacks.write_text(
        "\n".join(
            [
                f"{LOOP};EpollSelector.select (selectors.py:468) 500",
                f"{THREAD};{aiosqlite_wait} 400",
                f"{THREAD};{pool_wait} 100",
                f"{THREAD};_connection_worker_thread (aiosqlite/core.py:62) 10",
                f"{LOOP};Session.execute (sqlalchemy/orm/session.py:2300) 30",
                f"{LOOP};EncryptionCodec.encode (roundtable/codec.py:105) 10",
                # A store call in a task of its own, its statement on the event loop:
                f"{LOOP};Leases.claim (roundtable/store/leases.py:110);"
                "OneTripConnection._steps_from (roundtable/store/sqlite_driver.py:320) 20",
                f"{LOOP};Leases.claim (roundtable/store/leases.py:110);"
                "_Grant.of (roundtable/store/leases.py:496) 10",
                # The ticket system's statements go through the same driver:
                f"{LOOP};TicketSystem._finish (roundtable/tools/tickets.py:300);"
                "OneTripConnection._steps_from (roundtable/store/sqlite_driver.py:320) 20",
                "not a sample line",
            ]
        )
    )
    assert busy_samples([stacks]) == 100
    assert summary([stacks]) == [
        ("database: the store, SQLAlchemy and the driver, on the event loop", 40.0),
        ("database: SQLite's statements, on the event loop", 20.0),
        ("the demo ticket system", 20.0),
        ("database: SQLite's thread (aiosqlite, the statement itself)", 10.0),
        ("payloads: conversion, encryption, visiting", 10.0),
    ]


def test_thread_cpu_is_read_beside_the_stacks(tmp_path: Path) -> None:
    stacks = tmp_path / "throughput-200-ours.txt"
    stacks.write_text("")
    (tmp_path / "throughput-200-ours-threads.txt").write_text(
        "event loop\t12.50\nSDK core (Rust)\t3.00\n"
    )
    other = tmp_path / "approvals-ours.txt"  # profiled before threads were counted
    other.write_text("")
    assert thread_seconds([stacks, other]) == {"event loop": 12.5, "SDK core (Rust)": 3.0}


def test_a_workers_threads_are_told_apart() -> None:
    import os

    from bench.stack import thread_cpu

    spent = thread_cpu(os.getpid())
    assert "event loop" in spent and all(seconds >= 0 for seconds in spent.values())


def test_the_sdks_workflow_threads_are_not_counted_as_the_databases() -> None:
    """The kernel names these threads after the process; their Python names
    (from py-spy) tell the SDK's workflow task threads from aiosqlite's."""
    import os
    import threading

    from bench.stack import python_thread_names, thread_cpu

    release = threading.Event()

    def spin_then_wait() -> None:
        spun = 0
        while spun < 200_000:
            spun += 1
        release.wait()

    threads = [
        threading.Thread(target=spin_then_wait, name="temporal_workflow__0"),
        threading.Thread(target=spin_then_wait, name="Thread-9 (_connection_worker_thread)"),
    ]
    for thread in threads:
        thread.start()
    try:
        names = python_thread_names(os.getpid())
        assert names[str(threads[0].native_id)] == "temporal_workflow__0"
        assert names[str(os.getpid())] == "MainThread"
        spent = thread_cpu(os.getpid(), names)
        assert {"event loop", "workflow activations", "SQLite's threads (aiosqlite)"} <= set(spent)
    finally:
        release.set()
        for thread in threads:
            thread.join()


def test_a_thread_that_ends_in_the_window_is_not_lost() -> None:
    """Its CPU goes with it from /proc/PID/task, not from the process's own
    figure: what the process spent beyond its living threads is reported."""
    import os
    import threading
    import time

    from bench.stack import ENDED, cpu_seconds, python_thread_names, thread_times, window_by_kind

    pid = os.getpid()
    before, names, process = thread_times(pid), python_thread_names(pid), cpu_seconds(pid)

    def spin() -> None:
        until = time.thread_time() + 0.4
        while time.thread_time() < until:
            pass

    worker = threading.Thread(target=spin, name="Thread-7 (_connection_worker_thread)")
    worker.start()
    worker.join()
    # join() returns once Python is done with the thread, a moment before
    # the kernel's thread exits: until then /proc still lists it, living
    # (a loaded CI machine caught it there).
    task = f"/proc/{pid}/task/{worker.native_id}"
    deadline = time.monotonic() + 10
    while os.path.exists(task) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not os.path.exists(task)
    spent = window_by_kind(pid, before, names, process)
    assert spent[ENDED] >= 0.3
