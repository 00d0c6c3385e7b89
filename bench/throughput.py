"""Throughput: runs started at once, until every one has its result.

Ours: three seats, two rounds and a manager (the scripted model), with two
writes (``ticket_comment``, R1) the run's write policy approves on its own
(``auto_approve_up_to:R1``, within the worker's service ceiling), each on a
ticket of its own run, so no run waits for another's lease. Bare: the same
seven turns and two row writes (bench/bare.py ``BareRun``). Batches of bare
and ours alternate; each side's worker CPU is read before and after its
batch, and the figures are the median batch (``measure``).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from statistics import median
from typing import Any

from bench import bare
from bench.stack import BARE, OURS, Stack, cpu_seconds, sampled
from roundtable.models import RunInput, RunResult, WorkflowArgs
from roundtable.names import RUN_WORKFLOW

POLICY = "auto_approve_up_to:R1"
# The worker lets a run started straight through Temporal use at most this.
WORKER_ENV = {"ROUNDTABLE_POLICY_CEILING_SERVICE": POLICY}


def run_script(key: str) -> dict[str, Any]:
    """Our run's script: every seat speaks each round; two of them write."""
    turns = []
    for round_number in bare.ROUNDS:
        for seat in bare.SEATS:
            turn: dict[str, Any] = {"seat": seat, "round": round_number, "text": "noted"}
            if (seat, round_number) in bare.WRITES:
                args = {"tenant_id": "acme", "ticket_id": f"{key}-{seat}", "body": "on it"}
                turn["tool_calls"] = [{"name": "ticket_comment", "args": args}]
            turns.append(turn)
    return {"turns": turns, "final": "done"}


async def run_ours(stack: Stack, runs: int) -> None:
    client = stack.ours_client
    assert client is not None

    async def one() -> None:
        key = f"tp-{uuid.uuid4().hex[:12]}"
        request = RunInput(
            run_id=key,
            task_text="bench",
            seats=list(bare.SEATS),
            max_rounds=len(bare.ROUNDS),
            write_policy=POLICY,
            script=run_script(key),
        )
        handle = await client.start_workflow(
            RUN_WORKFLOW,
            WorkflowArgs(request=request),
            id=key,
            task_queue=OURS,
            result_type=RunResult,
        )
        result = await handle.result()
        assert result.status == "completed", f"{key} ended {result.status}"

    await asyncio.gather(*(one() for _ in range(runs)))


async def run_bare(stack: Stack, runs: int) -> None:
    client = stack.bare_client
    assert client is not None

    async def one() -> None:
        key = f"tp-bare-{uuid.uuid4().hex[:12]}"
        await client.execute_workflow(bare.RUN, key, id=key, task_queue=BARE)

    await asyncio.gather(*(one() for _ in range(runs)))


async def _timed(stack: Stack, side: str, runs: int) -> dict[str, float]:
    pid = stack.pids()[side]
    server = stack.server
    cpu, started = cpu_seconds(pid), time.perf_counter()
    server_cpu = cpu_seconds(server) if server else 0.0
    await (run_ours if side == "ours" else run_bare)(stack, runs)
    elapsed = time.perf_counter() - started
    return {
        "seconds": elapsed,
        "cpu": cpu_seconds(pid) - cpu,
        "server_cpu": (cpu_seconds(server) - server_cpu) if server else 0.0,
    }


# Asked before each batch pair more_pairs could take, with the longest
# pair's wall seconds so far: whether another still fits (make bench's ten
# minutes, bench/__main__.py).
AnotherPair = Callable[[float], bool]


async def measure(
    stack: Stack, runs: int, repeats: int = 1, profile: Path | None = None
) -> dict[str, Any]:
    """``runs`` at once, ``repeats`` batches a side, alternating; ``profile``:
    sample both workers with py-spy while they run. Each side's figures are
    its median batch, each ratio the median of the batch pairs' ratios: one
    slow batch (a collection, the machine's noise) moves neither, and a pair
    shares the worker's age, which a run's CPU drifts with (bench/README)."""
    await _timed(stack, "bare", min(runs, 5))  # warm both workers
    await _timed(stack, "ours", min(runs, 5))
    taken: dict[str, list[dict[str, float]]] = {"bare": [], "ours": []}
    with sampled(stack.pids(), profile, f"throughput-{runs}"):
        for _ in range(repeats):
            await _pair(stack, runs, taken)
    return _figures(runs, taken)


async def more_pairs(
    stack: Stack, figures: dict[str, Any], up_to: int, another: AnotherPair
) -> dict[str, Any]:
    """``measure``'s figures with more batch pairs of the same size, up to
    ``up_to`` pairs in all, each only while ``another`` says it fits (asked
    with the longest pair so far); every pair's figures are kept, the
    medians taken over them all. The workers are warm: no warm-up."""
    runs = figures["runs_at_once"]
    taken = {side: list(figures[side]["by_batch"]) for side in ("bare", "ours")}
    while len(taken["bare"]) < up_to and another(_longest_pair(runs, taken)):
        await _pair(stack, runs, taken)
    return _figures(runs, taken)


async def _pair(stack: Stack, runs: int, taken: dict[str, list[dict[str, float]]]) -> None:
    for side in ("bare", "ours"):
        taken[side].append(_per_run(await _timed(stack, side, runs), runs))


def _longest_pair(runs: int, taken: dict[str, list[dict[str, float]]]) -> float:
    pairs = zip(taken["bare"], taken["ours"], strict=True)
    return max(runs / b["runs_per_s"] + runs / o["runs_per_s"] for b, o in pairs)


def _figures(runs: int, taken: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    figures: dict[str, Any] = {"runs_at_once": runs, "batches": len(taken["bare"])}
    for side, batches in taken.items():
        # Rounded: with an even number of pairs the median is the mean of two,
        # whose float noise (14.530000000000001) is no part of the figure.
        figures[side] = {key: round(median(b[key] for b in batches), 2) for key in batches[0]}
        figures[side]["by_batch"] = batches
    ratios = {"ratio_runs_per_s": "runs_per_s", "ratio_cpu_per_run": "cpu_ms_per_run"}
    for key, figure in ratios.items():
        pairs = zip(taken["ours"], taken["bare"], strict=True)
        figures[key] = round(median(o[figure] / b[figure] for o, b in pairs), 2)
    return figures


def _per_run(batch: dict[str, float], runs: int) -> dict[str, float]:
    return {
        "runs_per_s": round(runs / batch["seconds"], 2),
        "cpu_ms_per_run": round(1000 * batch["cpu"] / runs, 1),
        # The dev server's CPU for this side's runs: the machine's other
        # big cost, which bounds runs/s beside the worker's.
        "server_cpu_ms_per_run": round(1000 * batch["server_cpu"] / runs, 1),
    }
