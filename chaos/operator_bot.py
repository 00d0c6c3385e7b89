"""The operator bot: a person at the HTTP API with an operator token.

It approves, rejects, approves with edits, extends, and leaves some approvals
to expire (each approval's fate drawn once from the seed), and it reconciles
``unknown`` actions only after reading the ticket system's write log, as a
real operator would: applied → succeeded; refused, abandoned or absent →
failed; still ``started`` → wait (a write that stays ``started`` long after
its lease ran out was never applied: the demo system applies and logs in one
transaction); 409 ``attempt_may_be_running`` → try again at ``retry_at``. It
recovers runs the sweep calls stalled (roundtable/recovery.py); the API
refuses one that is not stalled by a nondeterminism, and the harness judges
every recovery (chaos/recoveries.py).

Every response body it receives is kept for the canary scan."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from roundtable.tools.tickets import TicketSystem

FINAL_RUNS = frozenset({"completed", "failed", "cancelled", "terminated"})
# How long a write may sit "started" in the log, after the bot first saw it
# unknown, before the bot concludes it never applied (lease 8 s; a frozen
# worker is the only way a started write can still land, and then the
# fencing token must refuse it once a successor has claimed the ticket).
STALE_STARTED_SECONDS = 12.0
# How long the bot leaves a stalled run it tried to recover before it tries again.
RECOVER_AGAIN_SECONDS = 10.0
FATES = (("approve", 0.45), ("reject", 0.12), ("edit", 0.10), ("extend", 0.13), ("expire", 0.20))


def idempotency_key(action: dict[str, Any]) -> str:
    """The key the worker gave the tool (activities/write_activities.py): the
    public action view does not carry it, so an operator rebuilds it."""
    return (
        f"{action['run_id']}:{action['agent_id']}:r{action['turn_index']}:"
        f"{action['logical_action_id']}"
    )


@dataclass
class OperatorBot:
    api_url: str
    token: str
    tickets: TicketSystem
    rng: random.Random
    responses_path: Path
    fates: dict[str, str] = field(default_factory=dict)
    done: set[str] = field(default_factory=set)
    not_before: dict[str, float] = field(default_factory=dict)
    first_started: dict[str, float] = field(default_factory=dict)
    counts: Counter[str] = field(default_factory=Counter)
    in_flight: int = 0
    in_flight_paths: list[str] = field(default_factory=list)
    _steps: int = 0

    @asynccontextmanager
    async def connected(self) -> AsyncIterator[None]:
        """The bot's HTTP client, for as long as the block runs."""
        async with httpx.AsyncClient(
            base_url=self.api_url,
            headers={"Authorization": f"Bearer {self.token}"},
            timeout=30,
        ) as http:
            self._http = http
            yield

    async def run(self, stop: asyncio.Event) -> None:
        async with self.connected():
            while not stop.is_set():
                try:
                    await self.step()
                except (httpx.HTTPError, OSError, ValueError) as exc:
                    # The API may be down (a fault): try again shortly.
                    self.counts[f"api_error:{type(exc).__name__}"] += 1
                await asyncio.sleep(0.5)

    async def _call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        self.in_flight += 1
        self.in_flight_paths.append(path)
        try:
            answer = await self._http.request(method, path, **kwargs)
        finally:
            self.in_flight -= 1
            self.in_flight_paths.remove(path)
        with self.responses_path.open("a") as out:
            out.write(f"{method} {path} {answer.status_code} {answer.text}\n")
        return answer

    async def step(self) -> None:
        self._steps += 1
        runs = await self.runs()
        # First: a stalled run's workflow takes no decision until it is recovered.
        await self.recover_stalled(runs)
        for approval in await self._pending():
            await self._decide(approval)
        await self._reconcile_unknowns(runs)

    # ----------------------------------------------------------------- approvals

    def _fate(self, approval: dict[str, Any]) -> str:
        if approval["id"] not in self.fates:
            roll, fate = self.rng.random(), "approve"
            for name, weight in FATES:
                if roll < weight:
                    fate = name
                    break
                roll -= weight
            if _editable(approval) and not self.counts["planned_edit"]:
                fate = "edit"  # the first editable write is edited: the path is always met
            elif fate == "edit" and not _editable(approval):
                fate = "approve"
            self.fates[approval["id"]] = fate
            self.counts[f"planned_{fate}"] += 1
        return self.fates[approval["id"]]

    async def _decide(self, approval: dict[str, Any]) -> None:
        approval_id = approval["id"]
        if approval_id in self.done or time.monotonic() < self.not_before.get(approval_id, 0):
            return
        fate = self._fate(approval)
        if fate == "expire":
            return
        path = f"/v1/approvals/{approval_id}"
        if fate == "extend":
            answer = await self._call("POST", f"{path}/extend", json={"seconds": 6})
            self._count("extend", answer)
            # Then decide it, a little later, as a person who asked for time would.
            self.fates[approval_id] = self.rng.choice(["approve", "reject"])
            self.not_before[approval_id] = time.monotonic() + 3
            return
        body: dict[str, Any] = {
            "decision": "rejected" if fate == "reject" else "approved",
            "reason": f"chaos bot: {fate}",
            "arguments_digest": approval["arguments_digest"],
        }
        if fate == "edit":
            edited = json.loads(json.dumps(approval["arguments"]))
            edited["fields"] = {**edited.get("fields", {}), "priority": "P0", "edited": True}
            body["arguments"] = edited
        answer = await self._call("POST", f"{path}/decision", json=body)
        self._count(fate, answer)
        if answer.status_code in (200, 403, 404, 409, 422):
            self.done.add(approval_id)

    def _count(self, what: str, answer: httpx.Response) -> None:
        self.counts[f"{what}:{answer.status_code}"] += 1

    # ----------------------------------------------------------------- unknowns

    async def _pending(self) -> list[dict[str, Any]]:
        return await self._every("/v1/approvals", status="pending")

    async def runs(self) -> list[dict[str, Any]]:
        return await self._every("/v1/runs")

    async def _every(self, path: str, **filters: str) -> list[dict[str, Any]]:
        """Every page of a list (they all answer {items, next_cursor})."""
        items, cursor = [], None
        while True:
            params = {"limit": 200, **filters, **({"cursor": cursor} if cursor else {})}
            answer = await self._call("GET", path, params=params)
            answer.raise_for_status()
            page = answer.json()
            items += page["items"]
            cursor = page["next_cursor"]
            if not cursor:
                return items

    async def _reconcile_unknowns(self, runs: list[dict[str, Any]]) -> None:
        # Open runs every step; closed ones too now and then (an unknown can
        # outlive its run's workflow).
        look = [r for r in runs if r["status"] not in FINAL_RUNS or self._steps % 10 == 0]
        unknown = []
        for run in look:
            answer = await self._call("GET", f"/v1/runs/{run['run_id']}/actions")
            if answer.status_code == 200:
                unknown += [a for a in answer.json() if a["status"] == "unknown"]
        if not unknown:
            return
        log = {w["idempotency_key"]: w for w in await self.tickets.write_log()}
        for action in unknown:
            await self._reconcile(action, log.get(idempotency_key(action)))

    async def recover_stalled(self, runs: list[dict[str, Any]]) -> None:
        """A run the sweep calls stalled is reset by an operator if its history
        no longer replays (the takeover finding, roundtable/recovery.py); the
        API refuses (409) one stalled for another reason (a frozen worker's
        tasks timing out): try that again later."""
        for run in (r for r in runs if r["status"] == "stalled"):
            key = f"recover:{run['run_id']}"
            if time.monotonic() < self.not_before.get(key, 0):
                continue
            answer = await self._call(
                "POST",
                f"/v1/runs/{run['run_id']}/recover",
                json={"note": "chaos bot: the run is stalled"},
            )
            self._count("recover", answer)
            self.not_before[key] = time.monotonic() + RECOVER_AGAIN_SECONDS

    async def _reconcile(self, action: dict[str, Any], write: dict[str, Any] | None) -> None:
        action_id = action["id"]
        if time.monotonic() < self.not_before.get(action_id, 0):
            return
        seen = "absent" if write is None else write["outcome"]
        if seen == "started":
            first = self.first_started.setdefault(action_id, time.monotonic())
            if time.monotonic() - first < STALE_STARTED_SECONDS:
                return  # it may still apply: wait
            seen = "started_stale"
        outcome = "succeeded" if seen == "applied" else "failed"
        answer = await self._call(
            "POST",
            f"/v1/actions/{action_id}/reconcile",
            json={"outcome": outcome, "note": f"chaos bot: ticket log says {seen}"},
        )
        self.counts[f"reconcile_{seen}:{answer.status_code}"] += 1
        if answer.status_code == 409 and answer.headers.get("retry-after"):
            self.not_before[action_id] = time.monotonic() + float(answer.headers["retry-after"])
        elif answer.status_code >= 500 or answer.status_code == 409:
            self.not_before[action_id] = time.monotonic() + 2


def _editable(approval: dict[str, Any]) -> bool:
    args = approval.get("arguments") or {}
    return (
        approval.get("tool_name") == "ticket_update"
        and isinstance(args.get("fields"), dict)
        and str(args.get("ticket_id", "")).strip() != ""
    )
