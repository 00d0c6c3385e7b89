"""What a CI log must show when the run goes wrong, while it goes wrong.

A CI run that hits its time limit is killed before pytest's summary: the
failures, their tracebacks and the slowest tests are never printed, and all
that is left is a progress line. Stop 23's CI ended that way (two failures,
then a test that held the run to its limit). So this plugin prints, as they
happen: a failure's traceback, each slow test with the run's elapsed time, and
the machine's state at the start (load, free disk, the busiest processes).
A watchdog thread prints every thread's stack and the event loop's tasks
when one test has run four minutes (before pytest-timeout's five; a signal
raised inside an event loop's callback can be swallowed, and the test runs
on). If the whole run passes ``ROUNDTABLE_TEST_BUDGET_SECONDS`` (default 75
min, under CI's 90 with the install), it prints them and ends the process: a
failure that says where it stood, not a timeout.
"""

from __future__ import annotations

import asyncio
import faulthandler
import io
import os
import shutil
import subprocess
import sys
import threading
import time

import pytest

SLOW_SECONDS = 45.0
_START = time.monotonic()


def _elapsed() -> str:
    seconds = int(time.monotonic() - _START)
    return f"{seconds // 60}m{seconds % 60:02d}s"


def machine_state() -> list[str]:
    """Load, cores, free disk and the busiest processes: enough to tell a slow
    machine, a full disk or a leftover process from a slow test."""
    lines = [f"machine: {os.cpu_count()} cores, load {os.getloadavg()}"]
    disk = shutil.disk_usage(os.getcwd())
    lines.append(f"machine: {disk.free / 2**30:.1f} GiB free of {disk.total / 2**30:.0f}")
    try:
        busiest = subprocess.run(
            ["ps", "-eo", "pcpu,rss,etime,args", "--sort=-pcpu"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        ).stdout.splitlines()[:6]
    except (OSError, subprocess.SubprocessError) as exc:
        busiest = [f"(ps failed: {exc})"]
    lines.extend(f"machine: {line[:160]}" for line in busiest)
    return lines


STALL_SECONDS = float(os.environ.get("ROUNDTABLE_TEST_STALL_SECONDS", 240))  # < timeout 300


class _Watch:
    """The current test and when it started, read by the watchdog thread."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.test: tuple[str, float] | None = None
        self.dumped: str | None = None


_watch = _Watch()


def _event_loop_of(thread_id: int) -> asyncio.AbstractEventLoop | None:
    """The event loop running in that thread, found on its stack (a hung
    async test shows only select() in a thread dump; its tasks say where)."""
    frame = sys._current_frames().get(thread_id)
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, asyncio.AbstractEventLoop):
            return candidate
        frame = frame.f_back
    return None


def _task_stacks(thread_id: int) -> str:
    loop = _event_loop_of(thread_id)
    if loop is None:
        return "(no event loop running)\n"
    for _ in range(5):  # the set may change under us; try again
        try:
            tasks = list(asyncio.all_tasks(loop))
            break
        except RuntimeError:
            time.sleep(0.01)
    else:
        return "(the task set kept changing)\n"
    out = io.StringIO()
    for task in tasks[:60]:
        out.write(f"task {task.get_name()} {task.get_coro()!r}\n")
        for frame in task.get_stack(limit=6):
            code = frame.f_code
            out.write(f"    {code.co_filename}:{frame.f_lineno} in {code.co_name}\n")
    return out.getvalue()


def _dump(stderr_fd: int, why: str) -> None:
    os.write(stderr_fd, f"\n[{_elapsed()}] {why}; every thread's stack:\n".encode())
    faulthandler.dump_traceback(file=stderr_fd, all_threads=True)
    text = _task_stacks(threading.main_thread().ident or 0)
    os.write(stderr_fd, f"[{_elapsed()}] the main thread's asyncio tasks:\n{text}".encode())


def _watchdog(budget: float, stderr_fd: int) -> None:
    deadline = time.monotonic() + budget
    while not _watch.done.wait(5.0):
        test = _watch.test
        if test is not None and _watch.dumped != test[0]:
            if time.monotonic() - test[1] > STALL_SECONDS:
                _watch.dumped = test[0]
                _dump(stderr_fd, f"{test[0]} has run {STALL_SECONDS:.0f} s")
        if time.monotonic() > deadline:
            _dump(stderr_fd, f"the test run passed its {budget:.0f} s budget")
            os._exit(3)


def pytest_configure(config: pytest.Config) -> None:
    budget = float(os.environ.get("ROUNDTABLE_TEST_BUDGET_SECONDS", 75 * 60))
    # The real stderr: during a test, pytest's capture holds fd 2, and what
    # is written there is lost with the process.
    capture = config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        stderr_fd = os.dup(2)
    threading.Thread(target=_watchdog, args=(budget, stderr_fd), daemon=True).start()


def pytest_unconfigure(config: pytest.Config) -> None:
    _watch.done.set()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> object:
    _watch.test = (item.nodeid, time.monotonic())
    try:
        return (yield)
    finally:
        _watch.test = None


def pytest_report_header(config: pytest.Config) -> list[str]:
    return machine_state()


@pytest.hookimpl(trylast=True)
def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    reporter = _reporter
    if reporter is None:
        return
    if report.failed:
        reporter.write_line("")
        reporter.write_line(f"[{_elapsed()}] FAILED {report.nodeid} ({report.when})", red=True)
        text = str(report.longrepr).splitlines()
        for line in text[-40:]:
            reporter.write_line(f"    {line}")
    elif report.when == "call" and report.duration >= SLOW_SECONDS:
        reporter.write_line("")
        reporter.write_line(f"[{_elapsed()}] slow: {report.nodeid} {report.duration:.0f}s")


_reporter = None


@pytest.hookimpl(trylast=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    global _reporter
    _reporter = session.config.pluginmanager.get_plugin("terminalreporter")
