"""The baseline: bare Temporal doing what our runs ask of it, and nothing else.

``BareApproval`` waits for an update (the decision), then runs one
non-retrying activity that writes one row to a SQLite file.
``DurableApproval`` is the least a safe approval can be (bench/floor.py): the
update records the decision with a local activity (one SQLite transaction)
before it returns, and the write's activity claims, writes and records its
outcome in three one-statement transactions. Two serve
bench/memory_floor.py, both unsandboxed as ours runs: ``ShapedWait`` holds
what our waiting run's history holds (its events, payload sizes and search
attributes), ``UnsandboxedApproval`` is ``BareApproval`` as it is. ``ShapedApproval``
is our one-write run whole, as Temporal sees it, with none of our code
(bench/floor.py). ``BareRun`` is
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
from temporalio.common import RetryPolicy, SearchAttributeKey, SearchAttributePair
from temporalio.worker import Worker

WORKFLOW = "BenchBareApproval"
DURABLE = "BenchDurableApproval"
RUN = "BenchBareRun"
SHAPED = "BenchShapedWait"
SHAPED_APPROVAL = "BenchShapedApproval"
UNSANDBOXED = "BenchUnsandboxedApproval"
DECIDE = "decide"
SEATS = ("seat-1", "seat-2", "seat-3")
ROUNDS = (1, 2)
WRITES = (("seat-1", 1), ("seat-2", 2))  # who writes when, as our run's script does
ONCE = RetryPolicy(maximum_attempts=1)
_DB = {"path": ""}


def create_table(path: str) -> None:
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE IF NOT EXISTS bench_writes (key TEXT PRIMARY KEY, at REAL)")
    # The durable approval's file, in WAL mode as our store's SQLite is (the
    # bare write keeps the file and journal it has always had).
    with sqlite3.connect(durable_path(path)) as db:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("CREATE TABLE IF NOT EXISTS bench_writes (key TEXT PRIMARY KEY, at REAL)")
        for table in (
            "bench_decisions (key TEXT PRIMARY KEY, decision TEXT, at REAL)",
            "bench_leases (key TEXT PRIMARY KEY, until REAL, done_at REAL)",
        ):
            db.execute(f"CREATE TABLE IF NOT EXISTS {table}")


def written_at(path: str, key: str) -> float | None:
    """When the activity committed ``key`` (this machine's clock)."""
    with sqlite3.connect(path) as db:
        row = db.execute("SELECT at FROM bench_writes WHERE key = ?", (key,)).fetchone()
    return row[0] if row else None


def _insert(key: str) -> None:
    with sqlite3.connect(_DB["path"], timeout=60) as db:
        db.execute("INSERT INTO bench_writes (key, at) VALUES (?, ?)", (key, time.time()))


def durable_path(path: str) -> str:
    return f"{path}.durable"


def _transaction(statement: str, params: tuple) -> None:  # type: ignore[type-arg]
    """One statement in a transaction of its own, as our store's SQLite runs
    them (WAL, synchronous=NORMAL, BEGIN IMMEDIATE)."""
    db = sqlite3.connect(durable_path(_DB["path"]), timeout=60, isolation_level=None)
    try:
        db.execute("PRAGMA synchronous=NORMAL")
        db.execute("BEGIN IMMEDIATE")
        db.execute(statement, params)
        db.execute("COMMIT")
    finally:
        db.close()


def recorded_at(path: str, key: str) -> float | None:
    """When the durable write's outcome was recorded (this machine's clock)."""
    with sqlite3.connect(durable_path(path)) as db:
        row = db.execute("SELECT done_at FROM bench_leases WHERE key = ?", (key,)).fetchone()
    return row[0] if row else None


@activity.defn(name="bench_record_decision")
async def record_decision(key_and_decision: list[str]) -> str:
    key, decision = key_and_decision
    statement = "INSERT INTO bench_decisions (key, decision, at) VALUES (?, ?, ?)"
    await asyncio.to_thread(_transaction, statement, (key, decision, time.time()))
    return decision


def _claim_write_record(key: str) -> None:
    _transaction("INSERT INTO bench_leases (key, until) VALUES (?, ?)", (key, time.time() + 30))
    _transaction("INSERT INTO bench_writes (key, at) VALUES (?, ?)", (key, time.time()))
    _transaction("UPDATE bench_leases SET done_at = ? WHERE key = ?", (time.time(), key))


@activity.defn(name="bench_claimed_write")
async def claimed_write(key: str) -> str:
    await asyncio.to_thread(_claim_write_record, key)
    return key


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


@workflow.defn(name=UNSANDBOXED, sandboxed=False)
class UnsandboxedApproval(BareApproval):
    """BareApproval on the SDK's unsandboxed runner, as our workflows run."""

    @workflow.run
    async def run(self, key: str) -> str:
        return await super().run(key)


# What our waiting run's history carries (one write waiting for approval,
# bench/approvals.py's ONE_WRITE; sizes in bytes of JSON, read off a real
# history at bf2bb99): the run's start, its registration (a local
# activity), a seat's turn (an activity), the write's intercept (a local
# activity), three search-attribute upserts and the approval's timer.
SHAPE = {
    "start": 800,
    "register": (254, 3012),
    "turn": (700, 880),
    "intercept": (259, 436),
}
# And what the rest of its history carries once decided (read off a real
# history at 6b51acc): the decision (a local activity inside the update),
# the write (an activity), the run's ending (a local activity).
DECIDED_SHAPE = {
    "decide": (230, 304),
    "write": (189, 171),
    "finish": (230, 110),
}
APPROVAL_TIMEOUT = timedelta(hours=1)
_STATUS = SearchAttributeKey.for_keyword("RoundtableStatus")
_USER = SearchAttributeKey.for_keyword("RoundtableUserId")
_PENDING = SearchAttributeKey.for_int("RoundtablePendingApprovals")
_UNKNOWN = SearchAttributeKey.for_int("RoundtableUnknownActions")


def _status(status: str, pending: int) -> list[SearchAttributePair]:  # type: ignore[type-arg]
    return [
        SearchAttributePair(_USER, "bench"),
        SearchAttributePair(_STATUS, status),
        SearchAttributePair(_UNKNOWN, 0),
        SearchAttributePair(_PENDING, pending),
    ]


@activity.defn(name="bench_sized")
async def sized(request: list) -> str:  # type: ignore[type-arg]
    """Text of the size asked for: a payload as large as ours."""
    return "x" * int(request[1])


@workflow.defn(name=SHAPED, sandboxed=False)
class ShapedWait:
    """Our waiting run's history without our code: the same events in the
    same order, payloads of the same sizes, no store and no codec."""

    def __init__(self) -> None:
        self.decision: str | None = None
        self.waits = False

    @workflow.run
    async def run(self, padding: str) -> str:
        await self._until_decided()
        return self.decision or ""

    async def _until_decided(self) -> None:
        """Our run from its start until its write is decided (or its
        approval expires)."""
        minute = timedelta(seconds=60)
        workflow.patched("shaped")  # ours has one patch: a marker and an upsert
        size_in, size_out = SHAPE["register"]
        await workflow.execute_local_activity(
            sized, ["x" * size_in, size_out], start_to_close_timeout=minute
        )
        workflow.upsert_search_attributes(_status("running", 0))
        size_in, size_out = SHAPE["turn"]
        await workflow.execute_activity(
            sized, ["x" * size_in, size_out], start_to_close_timeout=minute
        )
        size_in, size_out = SHAPE["intercept"]
        await workflow.execute_local_activity(
            sized, ["x" * size_in, size_out], start_to_close_timeout=minute
        )
        workflow.upsert_search_attributes(_status("waiting_approval", 1))
        self.waits = True
        await workflow.wait_condition(lambda: self.decision is not None, timeout=APPROVAL_TIMEOUT)

    @workflow.query(name="waiting")
    def waiting(self) -> bool:
        return self.waits and self.decision is None

    @workflow.update(name=DECIDE)
    async def decide(self, decision: str) -> str:
        self.decision = decision
        return decision


@activity.defn(name="bench_shaped_write")
async def shaped_write(request: list) -> str:  # type: ignore[type-arg]
    """Bare's write (one row) with a result as large as ours."""
    await asyncio.to_thread(_insert, request[0])
    return "x" * int(request[2])


@workflow.defn(name=SHAPED_APPROVAL, sandboxed=False)
class ShapedApproval(ShapedWait):
    """Our one-write run from its start to its result, as Temporal sees it,
    without our code (bench/floor.py): ``ShapedWait``, then the decision,
    the write and the run's end as ours records them (the same local
    activities, activity and upserts, payloads of ours' sizes); no store,
    no codec, no checks. The write is bare's (one row: the customer's side,
    which ours writes a ticket for)."""

    @workflow.run
    async def run(self, key: str) -> str:
        await self._until_decided()
        minute = timedelta(seconds=60)
        workflow.upsert_search_attributes(_status("running", 0))
        size_in, size_out = DECIDED_SHAPE["write"]
        await workflow.execute_activity(
            shaped_write,
            [key, "x" * size_in, size_out],
            start_to_close_timeout=minute,
            retry_policy=ONCE,
        )
        size_in, size_out = DECIDED_SHAPE["finish"]
        await workflow.execute_local_activity(
            sized, ["x" * size_in, size_out], start_to_close_timeout=minute
        )
        workflow.upsert_search_attributes(_status("completed", 0))
        return self.decision or ""

    @workflow.update(name=DECIDE)
    async def decide(self, decision: str) -> str:
        size_in, size_out = DECIDED_SHAPE["decide"]
        await workflow.execute_local_activity(
            sized, ["x" * size_in, size_out], start_to_close_timeout=timedelta(seconds=60)
        )
        self.decision = decision
        return decision


@workflow.defn(name=DURABLE)
class DurableApproval:
    def __init__(self) -> None:
        self.decision: str | None = None
        self.key = ""

    @workflow.run
    async def run(self, key: str) -> str:
        self.key = key
        await workflow.wait_condition(lambda: self.decision is not None)
        return await workflow.execute_activity(
            claimed_write,
            key,
            start_to_close_timeout=timedelta(seconds=30),
            retry_policy=ONCE,
        )

    @workflow.query(name="waiting")
    def waiting(self) -> bool:
        return self.decision is None

    @workflow.update(name=DECIDE)
    async def decide(self, decision: str) -> str:
        self.decision = await workflow.execute_local_activity(
            record_decision, [self.key, decision], start_to_close_timeout=timedelta(seconds=30)
        )
        return self.decision


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
    # The SDK's default (sandboxed) runner, as bare Temporal runs out of the
    # box; ours runs unsandboxed (bench/README, "What was cut", says what the
    # sandbox costs each side).
    worker = Worker(
        client,
        task_queue=queue,
        workflows=[
            BareApproval,
            BareRun,
            DurableApproval,
            ShapedApproval,
            ShapedWait,
            UnsandboxedApproval,
        ],
        activities=[write_row, take_turn, record_decision, claimed_write, sized, shaped_write],
    )
    await worker.run()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--address", required=True)
    parser.add_argument("--queue", required=True)
    parser.add_argument("--db", required=True)
    args = parser.parse_args()
    asyncio.run(serve(args.address, args.queue, args.db))
