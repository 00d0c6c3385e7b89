"""The Roundtable store: the single writer of every status column.

Use :func:`open_store`.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from roundtable.config import PoolSizing, load_settings
from roundtable.states import (
    FINAL_RUN_STATUSES,
    ActionStatus,
    ApprovalStatus,
    ClaimOutcome,
    RunStatus,
)
from roundtable.store.actions import Actions
from roundtable.store.approvals import Approvals
from roundtable.store.catalog import ToolCatalog
from roundtable.store.database import Database
from roundtable.store.engine import create_engine_for
from roundtable.store.errors import (
    AttemptMayBeRunningError,
    ConflictError,
    ForbiddenError,
    InvalidInputError,
    NotFoundError,
    SchemaOutOfDateError,
    StoreError,
)
from roundtable.store.events import Events
from roundtable.store.inbox_sessions import InboxSessions
from roundtable.store.leases import Leases
from roundtable.store.migrate import require_current_schema, upgrade_database
from roundtable.store.reads import Reads
from roundtable.store.results import ToolResults
from roundtable.store.runs import RunGrant, Runs
from roundtable.store.sessions import Sessions
from roundtable.store.text import as_stored
from roundtable.store.tokens import Tokens
from roundtable.store.turns import Turns
from roundtable.store.webhooks import Webhooks

__all__ = [
    "FINAL_RUN_STATUSES",
    "ActionStatus",
    "ApprovalStatus",
    "AttemptMayBeRunningError",
    "ClaimOutcome",
    "ConflictError",
    "ForbiddenError",
    "InvalidInputError",
    "NotFoundError",
    "RunGrant",
    "RunStatus",
    "SchemaOutOfDateError",
    "Store",
    "StoreError",
    "as_stored",
    "open_store",
]


def _on(repository: str, method: Callable[..., Any]) -> Any:
    """A store method that is ``method`` of the named repository, under the
    name callers (the README, the reference safety test) have always used."""

    @functools.wraps(method)
    async def forwarded(self: Store, *args: Any, **kwargs: Any) -> Any:
        return await getattr(getattr(self, repository), method.__name__)(*args, **kwargs)

    return forwarded


class Store:
    """Sessions, runs, actions, approvals, leases, events, tokens, webhooks,
    tool results, model turns and the tool catalog: one repository each (``store.actions``,
    ``store.leases``, …), each owning its rows and their transitions, over one :class:`Database`
    (transactions, row locks, compare-and-set, the audit append). Every
    method is one or more atomic transactions and returns plain dicts or
    outcome strings.

    A caller cancelled mid-call (an activity cancelled, a timeout) never
    abandons a database call half-way: the call runs to its own end first,
    then the cancellation goes on. Abandoned mid-transaction, an aiosqlite
    connection was seen to keep SQLite's write lock for a minute, stalling
    every writer (test_store_cancellation.py)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.db = Database(engine)
        self.engine = engine
        self.session_factory = self.db.session_factory
        self.sessions = Sessions(self.db)
        self.events = Events(self.db)
        self.approvals = Approvals(self.db)
        self.actions = Actions(self.db, self.approvals)
        self.leases = Leases(self.db)
        self.runs = Runs(self.db, self.sessions, self.actions, self.leases)
        self.tokens = Tokens(self.db)
        self.webhooks = Webhooks(self.db)
        self.results = ToolResults(self.db)
        self.turns = Turns(self.db)
        self.reads = Reads(self.db)
        self.catalog = ToolCatalog(self.db)
        self.inbox_sessions = InboxSessions(self.db)

    async def close(self) -> None:
        """Give back the connections held between calls (open_store does,
        before it disposes of the engine)."""
        await self.db.close()

    # The names the store has always answered to, each one repository's method.
    create_session = _on("sessions", Sessions.create)
    get_session = _on("sessions", Sessions.get)
    list_sessions = _on("sessions", Sessions.list)

    create_run = _on("runs", Runs.create)
    ensure_run = _on("runs", Runs.ensure)
    get_run = _on("runs", Runs.get)
    list_runs = _on("runs", Runs.list)
    set_run_status = _on("runs", Runs.set_status)
    pin_snapshot = _on("runs", Runs.pin_snapshot)
    kept_snapshot = _on("runs", Runs.kept_snapshot)
    record_refusal = _on("runs", Runs.record_refusal)
    begin_recovery = _on("runs", Runs.begin_recovery)
    end_recovery = _on("runs", Runs.end_recovery)
    settle_closed_run = _on("runs", Runs.settle_closed)

    create_action = _on("actions", Actions.create)
    get_action = _on("actions", Actions.get)
    list_actions = _on("actions", Actions.list)
    get_action_arguments = _on("actions", Actions.arguments)
    withdraw_action = _on("actions", Actions.withdraw)
    find_action_by_idempotency_key = _on("actions", Actions.find_by_idempotency_key)
    check_reconcilable = _on("actions", Actions.check_reconcilable)
    reconcile_action = _on("actions", Actions.reconcile)
    refuse_reconcile = _on("actions", Actions.refuse_reconcile)
    reconciled_by_request = _on("actions", Actions.reconciled_by_request)
    reconcile_clock = _on("actions", Actions.reconcile_clock)

    create_approval = _on("approvals", Approvals.create)
    get_approval = _on("approvals", Approvals.get)
    list_approvals = _on("approvals", Approvals.list)
    decide_approval = _on("approvals", Approvals.decide)
    approve_with_edits = _on("approvals", Approvals.approve_with_edits)
    extend_approval = _on("approvals", Approvals.extend)
    keyed_approval_change = _on("approvals", Approvals.keyed_change)
    approval_standing = _on("approvals", Approvals.standing)
    expire_approval = _on("approvals", Approvals.expire)
    expire_due_approvals = _on("approvals", Approvals.expire_due)

    claim_action_for_execution = _on("leases", Leases.claim)
    claim_for_execution = _on("leases", Leases.claim_for_execution)
    renew_action_lease = _on("leases", Leases.renew)
    hold_action_lease = _on("leases", Leases.hold)
    record_action_terminal_result = _on("leases", Leases.record_result)
    recover_expired_action_leases = _on("leases", Leases.recover_expired)
    live_lease_action_ids = _on("leases", Leases.live_action_ids)
    runs_waiting_on_target = _on("leases", Leases.waiting_on_target)

    list_events = _on("events", Events.list)
    events_page = _on("events", Events.page)
    verify_audit_chain = _on("events", Events.verify_chain)

    create_token = _on("tokens", Tokens.create)
    list_tokens = _on("tokens", Tokens.list)
    revoke_token = _on("tokens", Tokens.revoke)
    authenticate_token = _on("tokens", Tokens.authenticate)

    record_webhook_attempt = _on("webhooks", Webhooks.record_attempt)
    list_webhook_deliveries = _on("webhooks", Webhooks.list)
    webhook_deliveries_page = _on("webhooks", Webhooks.page)

    save_tool_result = _on("results", ToolResults.save)
    get_tool_result = _on("results", ToolResults.get)
    keep_turn = _on("turns", Turns.keep)
    kept_turn = _on("turns", Turns.kept)
    record_turn = _on("turns", Turns.record_usage)

    run_snapshot = _on("reads", Reads.run_snapshot)
    approvals_with_actions = _on("reads", Reads.approvals_with_actions)
    approval_and_action = _on("reads", Reads.approval_and_action)
    decision_context = _on("reads", Reads.decision_context)
    open_work = _on("reads", Reads.open_work)

    open_inbox_session = _on("inbox_sessions", InboxSessions.open)
    inbox_session = _on("inbox_sessions", InboxSessions.lookup)
    revoke_inbox_session = _on("inbox_sessions", InboxSessions.revoke)
    unknown_actions = _on("reads", Reads.unknown_actions)

    publish_tools = _on("catalog", ToolCatalog.publish)
    published_tools = _on("catalog", ToolCatalog.published)


@asynccontextmanager
async def open_store(
    database_url: str | None = None,
    *,
    migrate: bool = True,
    pool: PoolSizing | None = None,
) -> AsyncIterator[Store]:
    """Open the database at ``database_url`` (default: settings, and their
    pool with it) and yield the store; the engine is disposed on exit.
    ``pool``: PostgreSQL's pool sizes (default: SQLAlchemy's). With
    ``migrate`` (the worker, the API, ``roundtable dev``) the schema is
    brought to the newest first; without it (the CLI's other commands) an
    out-of-date schema is refused with SchemaOutOfDateError."""
    if database_url is None:
        settings = load_settings()
        database_url, pool = settings.database_url, pool or settings.database_pool()
    engine = create_engine_for(database_url, pool)
    try:
        if migrate:
            await upgrade_database(engine)
        else:
            await require_current_schema(engine)
        store = Store(engine)
        try:
            yield store
        finally:
            await store.close()
    finally:
        await engine.dispose()
