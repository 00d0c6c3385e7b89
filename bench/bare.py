"""The baseline: bare Temporal doing what our runs ask of it, and nothing else.

``BareApproval`` waits for an update (the decision), then runs one
non-retrying activity that writes one row to a SQLite file. ``BareRun`` is
the throughput shape (bench/throughput.py): the same model turns as our run
(three seats, two rounds, a manager), each an activity that returns text,
and the same two writes, each a non-retrying activity writing one row. No
store, no lease, no audit, no codec. Run as its own worker process, as ours is:

    .venv/bin/python -m bench.bare --address HOST:PORT --queue Q --db FILE
"""

from __future__ import annotations

import argparse
import asyncio
import sqlite3
import time
from datetime import timedelta

from temporalio import activity, workflow
from temporalio.client import Client
from temporalio.common import RetryPolicy
from temporalio.worker import Worker

WORKFLOW = "BenchBareApproval"
RUN = "BenchBareRun"
DECIDE = "decide"
SEATS = ("seat-1", "seat-2", "seat-3")
ROUNDS = (1, 2)
WRITES = (("seat-1", 1), ("seat-2", 2))  # who writes when, as our run's script does
ONCE = RetryPolicy(maximum_attempts=1)
_DB = {"path": ""}


def create_table(path: str) -> None:
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE IF NOT EXISTS bench_writes (key TEXT PRIMARY KEY, at REAL)")


def written_at(path: str, key: str) -> float | None:
    """When the activity committed ``key`` (this machine's clock)."""
    with sqlite3.connect(path) as db:
        row = db.execute("SELECT at FROM bench_writes WHERE key = ?", (key,)).fetchone()
    return row[0] if row else None


def _insert(key: str) -> None:
    with sqlite3.connect(_DB["path"], timeout=60) as db:
        db.execute("INSERT INTO bench_writes (key, at) VALUES (?, ?)", (key, time.time()))


@activity.defn(name="bench_write_row")
async def write_row(key: str) -> str:
    await asyncio.to_thread(_insert, key)
    return key


@workflow.defn(name=WORKFLOW)
class BareApproval:
    def __init__(self) -> None:
        self.decision: str | None = None

    @workflow.run
    async def run(self, key: str) -> str:
        await workflow.wait_condition(lambda: self.decision is not None)
        return await workflow.execute_activity(
            write_row,
            key,
            start_to_close_timeout=timedelta(seconds=30),
            retry_policy=ONCE,
        )

    @workflow.query(name="waiting")
    def waiting(self) -> bool:
        return self.decision is None

    @workflow.update(name=DECIDE)
    async def decide(self, decision: str) -> str:
        self.decision = decision
        return decision


@activity.defn(name="bench_take_turn")
async def take_turn(who: str) -> str:
    return f"{who} has spoken"


@workflow.defn(name=RUN)
class BareRun:
    @workflow.run
    async def run(self, key: str) -> str:
        minute = timedelta(seconds=60)
        for round_number in ROUNDS:
            for seat in SEATS:
                await workflow.execute_activity(
                    take_turn, f"{seat} in round {round_number}", start_to_close_timeout=minute
                )
                if (seat, round_number) in WRITES:
                    await workflow.execute_activity(
                        write_row,
                        f"{key}:{seat}:{round_number}",
                        start_to_close_timeout=minute,
                        retry_policy=ONCE,
                    )
        return await workflow.execute_activity(take_turn, "manager", start_to_close_timeout=minute)


async def serve(address: str, queue: str, db: str) -> None:
    _DB["path"] = db
    create_table(db)
    client = await Client.connect(address)
    worker = Worker(
        client,
        task_queue=queue,
        workflows=[BareApproval, BareRun],
        activities=[write_row, take_turn],
    )
    await worker.run()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--address", required=True)
    parser.add_argument("--queue", required=True)
    parser.add_argument("--db", required=True)
    args = parser.parse_args()
    asyncio.run(serve(args.address, args.queue, args.db))
