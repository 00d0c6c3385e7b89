"""The least a safe approval can cost on Temporal, beside bare and ours:

    .venv/bin/python -m bench.floor [--approvals N]

Issue 12 asks the decision call and the write recorded to stay within 1.5x
bare Temporal, whose update records nothing. A decision that must survive
the worker (ours: decided once, under the run lock, before the call
returns) needs at least a local activity and one database transaction inside
the update; a write under a lease needs at least a claim and a recorded
outcome around the write. ``bare.DurableApproval`` is exactly that and
nothing more: one-statement SQLite transactions, no checks, no audit, no
codec. Timed as bench/approvals.py times the other two, the three
alternating, one approval at a time; prints medians and ratios to bare.
Not part of `make bench` (a one-off measurement of what no design of this
kind can go under); bench/README.md quotes it.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics

from bench import approvals, bare
from bench.stack import Stack, stack


async def durable_once(made: Stack) -> dict[str, float]:
    return await approvals.bare_once(made, bare.DURABLE, bare.recorded_at)


async def measure(count: int) -> dict[str, dict[str, float]]:
    """Median seconds by side and figure."""
    sides = {"bare": approvals.bare_once, "durable": durable_once, "ours": approvals.ours_once}
    async with stack() as made:
        for once in sides.values():  # warm each side up
            await once(made)
        timed: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
        for _ in range(count):
            for side, once in sides.items():
                timed[side].append(await once(made))
    return {
        side: {figure: statistics.median(t[figure] for t in runs) for figure in runs[0]}
        for side, runs in timed.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--approvals", type=int, default=100)
    medians = asyncio.run(measure(parser.parse_args().approvals))
    for figure, label in approvals.FIGURES:
        base = medians["bare"][figure]
        shown = [
            f"{side} {1000 * m[figure]:.1f} ms ({m[figure] / base:.2f})"
            for side, m in medians.items()
        ]
        print(f"{label}, p50: " + ", ".join(shown))


if __name__ == "__main__":
    main()
