"""The workload: many concurrent scripted runs whose seats write to a few
tickets of one tenant, started through every public surface in turn (the
HTTP API, the typed client, the CLI). Comment bodies and resolutions carry the
canary: they are not safe argument fields, so they must stay encrypted."""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from chaos.stack import Stack
from roundtable.client import RoundtableClient, RunInput

TENANT = "acme"
TICKETS = ("T-1", "T-2", "T-3")
# The ticket tools always name a ticket; a blank id is accepted by their
# schema but cannot pin a target, so the write covers the whole namespace
# (roundtable/security.py derive_target). That is the one namespace-wide
# write the demo tools can make.
NAMESPACE_WIDE_TICKET = " "
LEASE_SECONDS = 8
HEARTBEAT_SECONDS = 3
SURFACES = ("http", "client", "cli")


@dataclass
class RunPlan:
    index: int
    surface: str
    policy: str
    approval_timeout: int
    script: dict[str, Any]
    seats: list[str]
    rounds: int
    mode: str

    def run_input(self) -> dict[str, Any]:
        return {
            "task_text": f"chaos run {self.index}",
            "seats": self.seats,
            "max_rounds": self.rounds,
            "mode": self.mode,
            "write_policy": self.policy,
            "model": "scripted",
            "script": self.script,
            "approval_timeout_seconds": self.approval_timeout,
            "lease_seconds": LEASE_SECONDS,
            "heartbeat_timeout_seconds": HEARTBEAT_SECONDS,
        }


def _call(
    rng: random.Random,
    canary: str,
    index: int,
    n: int,
    tickets: tuple[str, ...] = TICKETS,
    wide_share: float = 0.06,
) -> dict[str, Any]:
    ticket = rng.choice(tickets)
    roll = rng.random()
    base = {"tenant_id": TENANT, "ticket_id": ticket}
    if roll < wide_share:
        base["ticket_id"] = NAMESPACE_WIDE_TICKET
        return {"name": "ticket_update", "args": {**base, "fields": {"sweep": f"r{index}"}}}
    if roll < 0.45:
        fields = {"priority": rng.choice(["P1", "P2", "P3"]), "touched_by": f"run-{index}"}
        return {"name": "ticket_update", "args": {**base, "fields": fields}}
    if roll < 0.92:
        body = f"customer note {n} of run {index}: {canary}"
        return {"name": "ticket_comment", "args": {**base, "body": body}}
    return {"name": "ticket_close", "args": {**base, "resolution": f"fixed; {canary}"}}


def plan_run(
    rng: random.Random,
    canary: str,
    index: int,
    tickets: tuple[str, ...] = TICKETS,
    wide_share: float = 0.06,
) -> RunPlan:
    """A run of 1-3 seats and 1-2 rounds, each seat's turn making one or two
    writes to ``tickets`` (``wide_share`` of them namespace-wide)."""
    seats = [f"seat-{i}" for i in range(1, rng.choice([2, 2, 3]) + 1)]
    rounds = rng.choice([1, 1, 2])
    turns, n = [], 0
    for rnd in range(1, rounds + 1):
        for seat in seats:
            calls = []
            for _ in range(rng.choice([1, 1, 2])):
                n += 1
                call = _call(rng, canary, index, n, tickets, wide_share)
                calls.append({**call, "id": f"c{n}"})
            turns.append(
                {"seat": seat, "round": rnd, "text": f"{seat} r{rnd}", "tool_calls": calls}
            )
    return RunPlan(
        index=index,
        surface=SURFACES[index % len(SURFACES)],
        policy="auto_approve_up_to:R3" if rng.random() < 0.25 else "confirm_all_writes",
        approval_timeout=rng.randint(8, 20),
        script={"turns": turns, "final": f"run {index} done"},
        seats=seats,
        rounds=rounds,
        mode=rng.choice(["structured", "parallel"]),
    )


@dataclass
class Workload:
    stack: Stack
    token: str
    rng: random.Random
    canary: str
    started: dict[str, RunPlan] = field(default_factory=dict)
    surfaces: Counter[str] = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)
    _next: int = 0
    _client: RoundtableClient | None = None

    async def start_one(self) -> str | None:
        """Start the next run through its surface; None when the start failed
        (a fault may be under way; starts are retried with the same key)."""
        plan = plan_run(self.rng, self.canary, self._next)
        self._next += 1
        for _attempt in range(3):
            try:
                run_id = await self._start(plan)
            except Exception as exc:
                self.errors.append(f"run {plan.index} via {plan.surface}: {type(exc).__name__}")
                await asyncio.sleep(2)
                continue
            if run_id:
                self.started[run_id] = plan
                self.surfaces[plan.surface] += 1
                return run_id
        return None

    async def _start(self, plan: RunPlan) -> str | None:
        if plan.surface == "http":
            async with httpx.AsyncClient(base_url=self.stack.api_url, timeout=30) as http:
                answer = await http.post(
                    "/v1/runs",
                    json=plan.run_input(),
                    headers={
                        "Authorization": f"Bearer {self.token}",
                        # A retried POST must not start a second run.
                        "Idempotency-Key": f"chaos-{plan.index}",
                    },
                )
            if answer.status_code != 201:
                raise RuntimeError(f"POST /v1/runs {answer.status_code}")
            return answer.json()["run_id"]
        if plan.surface == "client":
            if self._client is None:
                self._client = await RoundtableClient.connect(
                    self.stack.address, task_queue=self.stack.task_queue
                )
            run_input = RunInput(**plan.run_input(), run_id=f"chaos-client-{plan.index}")
            return (await self._client.start_run(run_input)).run_id
        return await asyncio.to_thread(self._start_by_cli, plan)

    def _start_by_cli(self, plan: RunPlan) -> str | None:
        script = self.stack.workdir / "scripts" / f"run-{plan.index}.json"
        script.parent.mkdir(exist_ok=True)
        script.write_text(json.dumps(plan.script))
        code, out = self.stack.cli(
            "start",
            "--task",
            f"chaos run {plan.index}",
            "--seats",
            ",".join(plan.seats),
            "--rounds",
            str(plan.rounds),
            "--mode",
            plan.mode,
            "--policy",
            plan.policy,
            "--script",
            str(Path(script)),
            "--approval-timeout",
            str(plan.approval_timeout),
            "--lease-seconds",
            str(LEASE_SECONDS),
            "--heartbeat-timeout",
            str(HEARTBEAT_SECONDS),
        )
        if code != 0 or not isinstance(out, dict):
            raise RuntimeError(f"roundtable start exit {code}")
        return out["run_id"]
