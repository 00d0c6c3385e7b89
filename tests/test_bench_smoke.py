"""The short form of `make bench` (`python -m bench --smoke`): every figure
is produced, end to end, on a handful of runs. No timing is judged here,
only that each measurement works and yields a number."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from bench import approvals, scale
from bench.__main__ import AFTER_PAIRS_SECONDS, BUDGET_SECONDS, pair_fits
from bench.report import rows

ROOT = Path(__file__).resolve().parent.parent


MODES = ("sequential", "concurrent")


def _positive(value: object) -> bool:
    return isinstance(value, int | float) and value > 0


def _scale_workdirs() -> set[Path]:
    return set(Path(tempfile.gettempdir()).glob(f"{scale.WORKDIR_PREFIX}*"))


@pytest.mark.timeout(560)
def test_the_benchmark_produces_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "latest.json"
    workdirs = _scale_workdirs()
    done = subprocess.run(
        [sys.executable, "-m", "bench", "--smoke", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=540,
        check=False,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    figures = json.loads(out.read_text())
    # What was measured: the commit, and whether its checkout was clean.
    head = subprocess.run(
        [shutil.which("git") or "git", "rev-parse", "HEAD"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert figures["source"]["commit"] == head.stdout.strip()
    assert isinstance(figures["source"]["clean"], bool)

    approvals = figures["approvals"]
    for key in ("update", "write", "result"):
        for side in ("bare", "ours"):
            assert _positive(approvals[key][side]["p50_ms"])
            assert _positive(approvals[key][side]["p95_ms"])
        assert _positive(approvals[key]["ratio_p50"])
    for side in ("bare", "ours"):  # the server's wait: a few ms, rounded, may be 0.0
        waited = approvals["pickup"][side]
        assert 0 <= waited["p50_ms"] <= waited["p95_ms"] <= approvals["result"][side]["p95_ms"]
    cpu = approvals["worker_cpu_per_approval"]
    assert _positive(cpu["bare_ms"]) and _positive(cpu["ours_ms"])
    history = approvals["history_events"]
    assert _positive(history["ours_per_approved_write"]) and _positive(history["bare_workflow"])

    for shape in [figures["throughput"], *figures["scaling"]]:
        for side in ("bare", "ours"):
            assert _positive(shape[side]["runs_per_s"])
            assert _positive(shape[side]["cpu_ms_per_run"])
            assert _positive(shape[side]["server_cpu_ms_per_run"])  # the server was found
    assert len(figures["scaling"]) >= 2
    # The main figure is the median of several batch pairs, each kept: the
    # smoke's two, and the third its budget (far from spent) lets it take
    # after the scaling points.
    batched = figures["throughput"]
    assert batched["batches"] == 3
    for side in ("bare", "ours"):
        assert [_positive(b["cpu_ms_per_run"]) for b in batched[side]["by_batch"]] == [True] * 3

    for database in ("sqlite", "postgresql"):  # CI installs PostgreSQL: never skipped
        for mode in MODES:
            claim = figures["claims"][database][mode]
            assert _positive(claim["store_claims_per_s"]) and _positive(claim["baseline_per_s"])
            assert _positive(claim["statements_per_claim"])
            assert claim["round_trips_per_claim"] >= 2  # a transaction's end is a trip of its own
            # The first pass, on a fresh engine, is kept apart from the warm ones.
            assert _positive(claim["cold_store_claims_per_s"])
            assert _positive(claim["cold_baseline_per_s"])
    # The claims' floors: their statements replayed with no Python of the store's.
    for database, mode in [("sqlite", "sequential"), *(("postgresql", m) for m in MODES)]:
        floor = figures["claims"][database][mode]
        assert _positive(floor["floor_ratio"]) and _positive(floor["replayed_us_per_upsert"])
        assert floor["replayed_us_per_claim"] > floor["replayed_us_per_upsert"]  # more work in it
    # bench/README's table is printed from these figures (bench.report).
    table = rows(figures)
    assert sum("its floor" in row for row in table) == 3
    assert sum("its first pass" in row for row in table) == 4

    memory = figures["waiting_memory"]
    assert isinstance(memory["ours"]["kib_per_run"], int | float)
    assert isinstance(memory["bare"]["kib_per_run"], int | float)
    curve = figures["scale"]["curve"]  # on PostgreSQL, which CI installs
    assert [point["workers"] for point in curve] == [1, 2, 3]
    for point in curve:
        assert _positive(point["runs_per_s"]) and _positive(point["machine_busy"])
        cpu = point["cpu_ms_per_run"]
        assert {"temporal", "postgresql"} <= set(cpu) and all(ms >= 0 for ms in cpu.values())
    assert "scale curve on PostgreSQL" in done.stdout
    # A curve measured leaves no stack behind (its server's database, logs).
    assert _scale_workdirs() <= workdirs
    crash = figures["crash_to_unknown"]
    assert _positive(crash["unknown_after_s_median"])
    assert "crash → unknown" in done.stdout


def _bench(*args: str, timeout: float) -> str:
    """Run ``python -m bench.<args>``; its output, once it has succeeded."""
    done = subprocess.run(
        [sys.executable, "-m", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return done.stdout


@pytest.mark.timeout(300)
def test_the_floor_measures_every_side() -> None:
    """bench/floor.py (not part of `make bench`): one approval a side, after
    the check that the shaped run's history is ours' (it refuses otherwise)."""
    stdout = _bench("bench.floor", "--approvals", "1", timeout=280)
    assert "the shaped run did what ours did" in stdout, stdout
    lines = [line for line in stdout.splitlines() if ", p50: " in line]
    assert len(lines) == len(approvals.FIGURES) + 1, stdout  # and the worker's CPU
    sides = ("bare", "durable", "shaped", "ours")
    assert all(all(f"{side} " in line for side in sides) for line in lines)


@pytest.mark.timeout(400)
def test_the_memory_floor_measures_every_side() -> None:
    """bench/memory_floor.py (not part of `make bench`): a few waiting runs a
    side, each side's runs checked waiting before its memory is read (with
    so few runs the figure itself may be anything, even negative)."""
    stdout = _bench("bench.memory_floor", "--runs", "3", "--rounds", "1", timeout=380)
    measured = json.loads(stdout[stdout.index("\n{") :])
    assert set(measured) == {
        "bare (SDK's sandbox)",
        "bare, unsandboxed",
        "our history, no code of ours",
        "ours",
    }
    for side in measured.values():
        assert len(side["kib_per_run"]) == 1
        assert isinstance(side["median"], int | float)


def test_store_calls_measures_each_call() -> None:
    """bench/store_calls.py (not part of `make bench`): a few writes."""
    stdout = _bench("bench.store_calls", "--writes", "3", timeout=120)
    # Five calls on an approved write's path, two on a run's own.
    assert stdout.count("ms CPU per call") == 7, stdout


@pytest.mark.timeout(300)
def test_the_soak_measures_each_workers_growth(tmp_path: Path) -> None:
    """bench/soak.py (`make soak`, ten minutes) in its short form: the least
    batches, of a few runs each."""
    out = tmp_path / "soak.json"
    stdout = _bench("bench.soak", "--seconds", "0", "--runs", "3", "--json", str(out), timeout=280)
    figures = json.loads(out.read_text())
    for side in ("bare", "ours"):
        soaked = figures[side]
        assert soaked["batches"] >= 3 and soaked["runs"] == 3 * soaked["batches"]
        assert isinstance(soaked["rss_kib_per_run"], int | float)
        # Three batches: the first is the warm-up, two points make no error estimate.
        assert soaked["rss_kib_per_run_standard_error"] is None
        assert all(_positive(b["rss_kib"]) for b in soaked["by_batch"])
        assert all(_positive(mib) for mib in soaked["rss_mib_first_last"])
    assert "growth after warm-up" in stdout


@pytest.mark.parametrize("setting", ["NOEQUALS", "=1", " ROUNDTABLE_X=1", "A-B=1"])
def test_the_soak_refuses_a_malformed_worker_setting(setting: str) -> None:
    """A setting that could not reach a worker as written is refused, not
    shown as applied while it does nothing."""
    done = subprocess.run(
        [sys.executable, "-m", "bench.soak", "--worker-env", setting],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2 and "NAME=VALUE" in done.stderr, done.stderr


def test_the_soaks_slope_leaves_out_the_warm_up_and_says_how_loose_it_is() -> None:
    from bench.soak import growth

    def batches(rss: list[int]) -> list[dict]:
        return [
            {"runs_done": 200 * (i + 1), "rss_kib": kib, "cpu_ms_per_run": 60.0}
            for i, kib in enumerate(rss)
        ]

    # Three batches: the first (the warm-up's jump) is left out.
    assert growth(batches([200_000, 210_000, 210_000]))["rss_kib_per_run"] == 0
    steady = growth(batches([200_000, 210_000, 210_400, 210_800, 211_200, 211_600]))
    assert steady["rss_kib_per_run"] == 2.0 and steady["rss_kib_per_run_standard_error"] == 0
    noisy = growth(batches([200_000, 210_000, 220_000, 210_000, 220_000, 210_000]))
    assert noisy["rss_kib_per_run_standard_error"] > 0


def test_make_bench_takes_another_batch_pair_only_while_its_ten_minutes_allow() -> None:
    """The throughput's fourth and fifth pairs are the one part of `make
    bench` sized by the time left; they come after the scaling points, so
    only the last three figures are foreseen (AFTER_PAIRS_SECONDS). The
    two runs measured: after the scaling points, 448 s in with pairs of 47 s
    (the 687 s run) and about 400 s in with pairs of 33 s (the 597 s run);
    neither has room for a fourth. A faster machine, 340 s in with pairs
    of 33 s, takes both."""
    assert not pair_fits(448.0, 47.0)
    assert not pair_fits(400.0, 33.0)
    assert pair_fits(340.0, 33.0) and pair_fits(373.0, 33.0)
    exact = 300.0 + 40.0 + AFTER_PAIRS_SECONDS
    assert pair_fits(300.0, 40.0, budget=exact)
    assert not pair_fits(300.0, 40.0, budget=exact - 0.5)
    assert BUDGET_SECONDS < 600
