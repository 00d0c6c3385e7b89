"""What a waiting run costs the worker without our code, beside bare and ours:

    .venv/bin/python -m bench.memory_floor [--runs N] [--rounds R]

Issue 12 asks for at most 100 KiB of worker memory per run waiting for
approval. ``make bench`` measures ours against ``bare.BareApproval``, whose
history is four events. This one-off measurement adds two sides on bare's
worker, both on the SDK's unsandboxed runner as ours runs: the same bare
approval (what the sandbox adds to bare's figure), and ``bare.ShapedWait``,
which holds what our waiting run's history holds (the same events in the
same order, payloads of the same sizes, the same search attributes) with
none of our code, store or codec. Each side in turn, on a fresh worker
process, measured as bench/waiting.py measures (the growth of the worker's
VmRSS over ``runs`` waiting runs, after a warm-up); prints KiB per run. Not
part of `make bench`; bench/README.md quotes it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from bench import bare, waiting
from bench.stack import BARE, Stack, rss_kib, stack
from bench.throughput import WORKER_ENV
from roundtable.process_exit import leave


async def _finish_bare(made: Stack, workflow: str, argument: str) -> None:
    """Warm-up: a few runs of ``workflow`` that wait, are decided and finish
    (``argument``, or when empty each run's own key)."""
    client = made.bare_client
    assert client is not None
    for _ in range(3):
        key = f"warm-{uuid.uuid4().hex[:12]}"  # a bare write's row is keyed by it
        handle = await client.start_workflow(workflow, argument or key, id=key, task_queue=BARE)
        await waiting.until_waiting(handle)
        await handle.execute_update(bare.DECIDE, "approved")
        await handle.result()


def _on_bare(workflow: str, argument: str) -> tuple[Callable[..., Awaitable[None]], ...]:
    async def warm(made: Stack) -> None:
        await _finish_bare(made, workflow, argument)

    async def wait(made: Stack, runs: int) -> None:
        await waiting.bare_waiting(made, runs, workflow, argument)

    return warm, wait


SIDES: dict[str, tuple[str, tuple[Callable[..., Awaitable[None]], ...]]] = {
    "bare (SDK's sandbox)": ("bare", _on_bare(bare.WORKFLOW, "")),
    "bare, unsandboxed": ("bare", _on_bare(bare.UNSANDBOXED, "")),
    "our history, no code of ours": ("bare", _on_bare(bare.SHAPED, "x" * bare.SHAPE["start"])),
    "ours": ("ours", (waiting._warm, waiting._ours_waiting)),
}


async def _one(made: Stack, side: str, runs: int) -> float:
    process, (warm, wait) = SIDES[side]
    if process == "ours":
        made.restart_ours(WORKER_ENV)
    else:
        made.restart_bare()
    await asyncio.sleep(3)  # polling
    await warm(made)
    await asyncio.sleep(waiting.SETTLE_SECONDS)
    pid = made.pids()[process]
    before = rss_kib(pid)
    await wait(made, runs)
    await asyncio.sleep(waiting.SETTLE_SECONDS)
    return (rss_kib(pid) - before) / runs


async def measure(runs: int, rounds: int) -> dict[str, list[float]]:
    """KiB per waiting run, by side, one figure per round."""
    measured: dict[str, list[float]] = {side: [] for side in SIDES}
    async with stack(WORKER_ENV) as made:
        for round_number in range(rounds):
            for side in SIDES:
                measured[side].append(round(await _one(made, side, runs), 1))
                print(round_number, side, measured[side][-1], flush=True)
    return measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    measured = asyncio.run(measure(args.runs, args.rounds))
    summary: dict[str, Any] = {
        side: {"kib_per_run": kib, "median": round(statistics.median(kib), 1)}
        for side, kib in measured.items()
    }
    print(json.dumps(summary, indent=2))
    leave(0)


if __name__ == "__main__":
    main()
