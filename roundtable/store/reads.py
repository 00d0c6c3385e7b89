"""Reads that must agree with themselves: one transaction, one snapshot.

A view made of several reads in separate transactions can see a write half
done (an approval whose action it has not read yet). Every read here runs in
one read-only transaction; on PostgreSQL at REPEATABLE READ, so all its
statements see the database as of the first, and on SQLite a deferred
transaction in WAL mode, which does the same.

Lists are paged by keyset (the last row's sort key), with a fixed number of
queries whatever the page size.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import func, select

from roundtable.completion import complete_every_public_coroutine
from roundtable.states import ActionStatus, ApprovalStatus
from roundtable.store.database import Database, found
from roundtable.store.errors import InvalidInputError, NotFoundError
from roundtable.store.rows import page_after, row_to_dict
from roundtable.store.schema import ActionRow, ApprovalRow, AuditEventRow, RunRow
from roundtable.store.turns import TURN_COMPLETED


@complete_every_public_coroutine
class Reads:
    """Views over several aggregates, each read as of one instant
    (``Database.snapshot``); a run's events and webhook deliveries page in
    their own repositories the same way."""

    def __init__(self, db: Database) -> None:
        self.db = db

    async def run_snapshot(self, run_id: str) -> dict[str, Any]:
        """A run with its actions, approvals and turn events, as of one instant."""
        async with self.db.snapshot() as session:
            run = await found(session, RunRow, run_id)
            actions = await session.execute(
                select(ActionRow)
                .where(ActionRow.run_id == run_id)
                .order_by(ActionRow.created_at, ActionRow.id)
            )
            actions_list = [row_to_dict(r) for r in actions.scalars()]
            approvals = await session.execute(
                select(ApprovalRow)
                .where(ApprovalRow.run_id == run_id)
                .order_by(ApprovalRow.created_at, ApprovalRow.id)
            )
            approvals_list = [row_to_dict(r) for r in approvals.scalars()]
            turns = await session.execute(
                select(AuditEventRow.payload)
                .where(AuditEventRow.run_id == run_id, AuditEventRow.event_type == TURN_COMPLETED)
                .order_by(AuditEventRow.seq)
            )
            return {
                "run": row_to_dict(run),
                "actions": actions_list,
                "approvals": approvals_list,
                "turns": list(turns.scalars()),
            }

    async def approvals_with_actions(
        self,
        *,
        run_id: str | None = None,
        approval_id: str | None = None,
        status: str | None = None,
        user_id: str | None = None,
        limit: int | None = None,
        after: tuple[datetime, str] | None = None,
    ) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        """(approval, its action) pairs, oldest first, in one query: the
        approval list used to read each row's run and action separately.
        ``user_id`` keeps the approvals of that user's runs only."""
        if status is not None and status not in set(ApprovalStatus):
            raise InvalidInputError(f"unknown approval status {status!r}")
        query = (
            select(ApprovalRow, ActionRow)
            .join(ActionRow, ActionRow.id == ApprovalRow.action_id)
            .order_by(ApprovalRow.created_at, ApprovalRow.id)
        )
        if user_id is not None:
            query = query.join(RunRow, RunRow.id == ApprovalRow.run_id).where(
                RunRow.user_id == user_id
            )
        if run_id is not None:
            query = query.where(ApprovalRow.run_id == run_id)
        if approval_id is not None:
            query = query.where(ApprovalRow.id == approval_id)
        if status is not None:
            query = query.where(ApprovalRow.status == status)
        query = page_after(query, ApprovalRow, after, limit)
        async with self.db.snapshot() as session:
            rows = (await session.execute(query)).all()
            return [(row_to_dict(approval), row_to_dict(action)) for approval, action in rows]

    async def approval_and_action(self, approval_id: str) -> tuple[dict[str, Any], dict[str, Any]]:
        """An approval and its action, in one query as of one instant."""
        pairs = await self.approvals_with_actions(approval_id=approval_id)
        if not pairs:
            raise NotFoundError(f"approval {approval_id!r} not found")
        return pairs[0]

    async def decision_context(
        self, approval_id: str
    ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        """An approval, its action and its run, in one query: what a decision
        is checked against before it is recorded (under the run lock)."""
        query = (
            select(ApprovalRow, ActionRow, RunRow)
            .join(ActionRow, ActionRow.id == ApprovalRow.action_id)
            .join(RunRow, RunRow.id == ApprovalRow.run_id)
            .where(ApprovalRow.id == approval_id)
        )
        async with self.db.snapshot() as session:
            row = (await session.execute(query)).one_or_none()
        if row is None:
            raise NotFoundError(f"approval {approval_id!r} not found")
        approval, action, run = row
        return row_to_dict(approval), row_to_dict(action), row_to_dict(run)

    async def open_work(self) -> tuple[int, int]:
        """(pending approvals, unknown actions): what waits for a person,
        counted in the database (the metrics' gauges)."""
        pending = select(func.count()).where(ApprovalRow.status == ApprovalStatus.PENDING)
        unknown = select(func.count()).where(ActionRow.status == ActionStatus.UNKNOWN)
        async with self.db.snapshot() as session:
            counts = (
                await session.execute(select(pending.scalar_subquery(), unknown.scalar_subquery()))
            ).one()
        return int(counts[0]), int(counts[1])

    async def unknown_actions(
        self, *, user_id: str | None = None, limit: int = 200
    ) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        """(action, its run) for every ``unknown`` action, oldest first;
        ``user_id`` keeps that user's runs only (the inbox's list)."""
        query = (
            select(ActionRow, RunRow)
            .join(RunRow, RunRow.id == ActionRow.run_id)
            .where(ActionRow.status == ActionStatus.UNKNOWN)
            .order_by(ActionRow.updated_at, ActionRow.id)
            .limit(limit)
        )
        if user_id is not None:
            query = query.where(RunRow.user_id == user_id)
        async with self.db.snapshot() as session:
            rows = (await session.execute(query)).all()
            return [(row_to_dict(action), row_to_dict(run)) for action, run in rows]
