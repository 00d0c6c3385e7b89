"""Soak: does a worker's memory stay bounded, run after run?

    .venv/bin/python -m bench.soak [--seconds 600] [--runs 200] [--json FILE]
                                   [--worker-env NAME=VALUE ...]

Both workers (ours and bare, bench/stack.py) do batch after batch of the
throughput run shape (bench/throughput.py, ``runs`` at once), alternating,
for ``seconds`` and at least ``MIN_BATCHES`` batches a side. After each
batch, each worker's resident memory and CPU per run are read.

The figure is each side's memory growth per run: the least-squares slope
of its RSS against the runs it has done, over its batches after the first
quarter, or at least the first batch (caches fill while a worker warms up;
a leak keeps going), with its standard error. A soak of
7,200 runs once showed ours growing about 30 KiB a run with no ceiling,
from garbage that piled up between rare full collections (bench/README).
``--worker-env`` sets a variable for both workers, to soak a setting
(``ROUNDTABLE_WORKER_GC_THRESHOLDS=20000,20,20`` shows that finding again).
`make soak` runs ten minutes; `make test` a handful of small batches, which
checks only that every figure is produced.
"""

from __future__ import annotations

import argparse
import math
import re
import time
from pathlib import Path
from statistics import linear_regression, median
from typing import Any

from bench.outcome import finish
from bench.stack import Stack, cpu_seconds, rss_kib, stack
from bench.throughput import WORKER_ENV, run_bare, run_ours

MIN_BATCHES = 3  # a side: a slope needs two points after the warm-up batch
# Growth per run above this, after warm-up, is a leak to chase (KiB a run;
# batch-to-batch noise is about 10 MB, a few KiB a run over a ten-minute soak).
TARGET_KIB_PER_RUN = 5.0
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


async def _batch(made: Stack, side: str, runs: int, done: int) -> dict[str, Any]:
    pid = made.pids()[side]
    cpu = cpu_seconds(pid)
    await (run_ours if side == "ours" else run_bare)(made, runs)
    return {
        "runs_done": done + runs,
        "rss_kib": rss_kib(pid),
        "cpu_ms_per_run": round(1000 * (cpu_seconds(pid) - cpu) / runs, 1),
    }


def growth(batches: list[dict[str, Any]]) -> dict[str, Any]:
    """One side's figures from its batches (in the order they ran)."""
    quarter = max(1, len(batches) // 4)  # the warm-up: at least the first batch
    settled = batches[quarter:]
    runs = [b["runs_done"] for b in settled]
    rss = [b["rss_kib"] for b in settled]
    slope, intercept = linear_regression(runs, rss)
    return {
        "runs": batches[-1]["runs_done"],
        "batches": len(batches),
        "rss_mib_first_last": [
            round(batches[0]["rss_kib"] / 1024, 1),
            round(batches[-1]["rss_kib"] / 1024, 1),
        ],
        "rss_kib_per_run": round(slope, 2),
        # How far the slope can be trusted: batch-to-batch RSS moves by
        # megabytes, so a short soak's slope is loose (None: two points).
        "rss_kib_per_run_standard_error": _standard_error(runs, rss, slope, intercept),
        "cpu_ms_per_run_first_last_quarter": [
            round(median(b["cpu_ms_per_run"] for b in batches[:quarter]), 1),
            round(median(b["cpu_ms_per_run"] for b in batches[-quarter:]), 1),
        ],
        "by_batch": batches,
    }


def _standard_error(
    xs: list[float], ys: list[float], slope: float, intercept: float
) -> float | None:
    """The least-squares slope's standard error."""
    if len(xs) < 3:
        return None
    residuals = sum((y - (slope * x + intercept)) ** 2 for x, y in zip(xs, ys, strict=True))
    mean = sum(xs) / len(xs)
    spread = sum((x - mean) ** 2 for x in xs)
    return round(math.sqrt(residuals / (len(xs) - 2) / spread), 2)


async def measure(seconds: float, runs: int, worker_env: dict[str, str]) -> dict[str, Any]:
    taken: dict[str, list[dict[str, Any]]] = {"bare": [], "ours": []}
    async with stack({**WORKER_ENV, **worker_env}) as made:
        began = time.monotonic()
        while time.monotonic() - began < seconds or len(taken["ours"]) < MIN_BATCHES:
            for side, batches in taken.items():
                done = batches[-1]["runs_done"] if batches else 0
                batches.append(await _batch(made, side, runs, done))
        figures: dict[str, Any] = {side: growth(b) for side, b in taken.items()}
    figures.update(
        runs_at_once=runs,
        seconds=round(time.monotonic() - began),
        worker_env=worker_env,
        target_kib_per_run=TARGET_KIB_PER_RUN,
    )
    return figures


def _print(figures: dict[str, Any]) -> None:
    print(
        f"soak: {figures['seconds']} s, {figures['runs_at_once']} runs at once a batch, "
        f"worker env {figures['worker_env'] or 'as default'}"
    )
    for side in ("bare", "ours"):
        f = figures[side]
        first, last = f["rss_mib_first_last"]
        cpu_first, cpu_last = f["cpu_ms_per_run_first_last_quarter"]
        print(
            f"  {side}: {f['runs']} runs in {f['batches']} batches; RSS {first} → {last} MiB, "
            f"growth after warm-up {f['rss_kib_per_run']} "
            f"± {f['rss_kib_per_run_standard_error']} KiB/run "
            f"(target ≤ {figures['target_kib_per_run']}); "
            f"CPU/run {cpu_first} → {cpu_last} ms (first → last quarter)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=600)
    parser.add_argument("--runs", type=int, default=200, help="runs at once, each batch")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument(
        "--worker-env", action="append", default=[], metavar="NAME=VALUE", help="for both workers"
    )
    args = parser.parse_args()
    worker_env = {}
    for pair in args.worker_env:
        name, sep, value = pair.partition("=")
        if not sep or not _NAME.fullmatch(name):
            parser.error(f"--worker-env takes NAME=VALUE, NAME a variable's name, not {pair!r}")
        worker_env[name] = value
    finish(measure(args.seconds, args.runs, worker_env), _print, args.json)


if __name__ == "__main__":
    main()
