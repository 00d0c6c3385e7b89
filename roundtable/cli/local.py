"""Operator commands on the database and Temporal directly: the CLI acts
with database access, as an operator would (roundtable/cli/operator.py)."""

from __future__ import annotations

import asyncio
import contextlib
import shlex
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from temporalio.client import Client

from roundtable import operations, recovery
from roundtable.cli.shared import actor, settings, store_from, temporal
from roundtable.config import Settings
from roundtable.models import RunInput, RunResult
from roundtable.permissions import Authority, Decider
from roundtable.store import FINAL_RUN_STATUSES, Store
from roundtable.views import approval_view, event_view, run_summary, run_view

EVENTS_PAGE = 200  # as the API's pages
POLL_SECONDS = 0.5  # as the API's event stream


class Local:
    via: tuple[str, ...] = ()  # the same settings reach the same database

    def __init__(self, config: Settings, store: Store) -> None:
        self.config, self.store = config, store
        self._client: Client | None = None
        # The settings (and the default database's path, and the dev stack's
        # secret) are read from the environment and the directory.
        self.via_note = (
            "these commands act on the database and Temporal directly: run them in "
            f"{shlex.quote(str(Path.cwd()))} with the same ROUNDTABLE_* settings as this one"
        )

    @classmethod
    @asynccontextmanager
    async def open(cls) -> AsyncIterator[Local]:
        config = settings()
        async with store_from(config) as store:
            yield cls(config, store)

    async def temporal(self) -> Client:
        """Connected on first need: reading the store needs no Temporal."""
        if self._client is None:
            self._client = await temporal(self.config)
        return self._client

    async def start(self, request: RunInput, idempotency_key: str | None = None) -> dict[str, Any]:
        authority = Authority.from_settings(self.config)
        request = authority.admit("operator", request)  # refused before connecting
        if idempotency_key is not None:
            # The run id the API would give the same key: starting again
            # with it starts nothing (operations.start_run), whatever became
            # of the first start.
            run_id = operations.idempotent_run_id(request.user_id, idempotency_key)
            request = request.model_copy(update={"run_id": run_id})
        started, _ = await operations.start_run(
            await self.temporal(),
            self.store,
            request,
            self.config.task_queue,
            authority=authority,
            role="operator",
        )
        return started

    async def run(self, run_id: str) -> dict[str, Any]:
        return await run_view(self.store, run_id)

    async def final_answer(self, run_id: str) -> str | None:
        """The workflow's result; the store is the record, this a convenience."""
        with contextlib.suppress(Exception):
            handle = (await self.temporal()).get_workflow_handle(run_id, result_type=RunResult)
            return (await asyncio.wait_for(handle.result(), 5)).final_answer
        return None

    async def runs(self, status: str | None, user: str | None, limit: int) -> list[dict]:
        rows = await self.store.list_runs(user_id=user, status=status, limit=limit)
        return [run_summary(row) for row in rows]

    async def approvals(self, run_id: str | None, status: str | None) -> list[dict]:
        if run_id is not None:
            await self.store.get_run(run_id)  # a mistyped run is not found, as over the API
        rows = await self.store.list_approvals(run_id=run_id, status=status)
        return [await approval_view(self.store, row) for row in rows]

    async def decide(
        self, approval_id: str, decision: str, reason: str | None, by: str | None
    ) -> dict[str, Any]:
        decider = actor(by)
        decided = await operations.decide(
            await self.temporal(),
            self.store,
            approval_id,
            decision,
            decider,
            reason,
            decider=Decider(user_id=decider, role="operator"),
        )
        decided.pop("replayed")  # sent under no key: never a replay
        return decided

    async def reconcile(
        self, action_id: str, outcome: str, note: str, by: str | None
    ) -> dict[str, Any]:
        # operations.reconcile checks the action (and nudges its run if it was
        # settled already), as it does for the API and the client.
        return await operations.reconcile(
            await self.temporal(),
            self.store,
            action_id,
            outcome,
            actor(by),
            note,
            self.config.task_queue,
        )

    async def recover(self, run_id: str, note: str, by: str | None) -> dict[str, Any]:
        return await recovery.recover_run(
            await self.temporal(), self.store, run_id, actor(by), note
        )

    async def events(self, run_id: str) -> list[dict[str, Any]]:
        await self.store.get_run(run_id)  # an unknown run is not found, not empty
        events, seen = [], None
        while True:
            page = await self.store.events_page(run_id, after_seq=seen, limit=EVENTS_PAGE)
            events += [event_view(e) for e in page]
            if len(page) < EVENTS_PAGE:
                return events
            seen = page[-1]["seq"]

    async def follow(self, run_id: str) -> AsyncIterator[dict[str, Any]]:
        seen = 0
        while True:
            # The status first: a run's last events commit with its final
            # status, so once it reads final, the read after it has them all.
            ended = (await self.store.get_run(run_id))["status"] in FINAL_RUN_STATUSES
            fresh = await self.store.events_page(run_id, after_seq=seen, limit=EVENTS_PAGE)
            for event in fresh:
                seen = event["seq"]
                yield event_view(event)
            if ended and not fresh:
                return
            if not fresh:
                await asyncio.sleep(POLL_SECONDS)
