"""Settings read from the environment (prefix ``ROUNDTABLE_``).

The action secret is deliberately *not* cached here: security functions read it
at call time through :func:`roundtable.security.read_action_secret`, so a
rotated or removed secret takes effect at once and the system fails closed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_STATE_DIR = Path(".roundtable")
DEFAULT_DATABASE_URL = f"sqlite+aiosqlite:///./{DEFAULT_STATE_DIR}/roundtable.db"


@dataclass(frozen=True)
class PoolSizing:
    """PostgreSQL's connection pool for one process's store (README, "The
    database pool"). None: SQLAlchemy's own (5 kept, 10 more at need, a
    checkout waiting up to 30 s)."""

    size: int | None = None
    overflow: int | None = None
    timeout_seconds: float | None = None

    def engine_options(self) -> dict[str, int | float]:
        """``create_async_engine``'s pool arguments for what is set."""
        options: dict[str, int | float] = {}
        if self.size is not None:
            options["pool_size"] = self.size
        if self.overflow is not None:
            options["max_overflow"] = self.overflow
        if self.timeout_seconds is not None:
            options["pool_timeout"] = self.timeout_seconds
        return options


class Settings(BaseSettings):
    """Process-wide configuration. Build one at start-up with :func:`load_settings`."""

    # A rule across fields (a model validator) fails quoting every value read,
    # the Temporal API key and the database password among them: never the input.
    model_config = SettingsConfigDict(
        env_prefix="ROUNDTABLE_", extra="ignore", hide_input_in_errors=True
    )

    database_url: str = Field(
        default=DEFAULT_DATABASE_URL,
        description="SQLAlchemy async URL: sqlite+aiosqlite:///… or postgresql+asyncpg://…",
    )
    # PostgreSQL's connection pool, in each process (README, "The database
    # pool"); unset: SQLAlchemy's. Not SQLite's: its writers share one held
    # connection, and its pool stays the store's own.
    database_pool_size: int | None = Field(default=None, ge=1, le=1000)
    database_max_overflow: int | None = Field(default=None, ge=0, le=1000)
    # At least a tenth of a second: a checkout that may not wait at all
    # fails whenever every connection is lent, however briefly.
    database_pool_timeout_seconds: float | None = Field(
        default=None, ge=0.1, le=3600, allow_inf_nan=False
    )
    max_approval_extension_seconds: int = Field(default=7 * 24 * 3600, gt=0)
    temporal_address: str = "localhost:7233"
    temporal_namespace: str = "default"
    # A Temporal cluster that wants TLS (README, "Production: connecting to a
    # Temporal cluster"); roundtable/temporal.py checks the combination and
    # reads the files when connecting. Left unset: plain, as to the dev
    # server. TLS is on when any of the others is set, unless turned off.
    temporal_tls: bool | None = None
    temporal_tls_client_cert_path: Path | None = None
    temporal_tls_client_key_path: Path | None = None
    temporal_tls_server_ca_cert_path: Path | None = None
    temporal_tls_server_name: str | None = None
    temporal_api_key: SecretStr | None = None  # never in a repr, a log or an error
    temporal_api_key_file: Path | None = None

    @field_validator("worker_gc_thresholds")
    @classmethod
    def _three_positive_thresholds(cls, value: str) -> str:
        """gc.set_threshold's three, each at least 1 (a first threshold of 0
        would turn automatic collection off: cycles would never be freed)."""
        if not value.strip():
            return ""
        parts = value.split(",")
        if len(parts) != 3 or not all(p.strip().isdigit() and int(p) >= 1 for p in parts):
            raise ValueError("three whole numbers of at least 1, comma-separated: 20000,20,20")
        return ",".join(str(int(p)) for p in parts)

    def gc_thresholds(self) -> tuple[int, int, int] | None:
        """``worker_gc_thresholds`` as gc.set_threshold takes them; None: Python's own."""
        if not self.worker_gc_thresholds:
            return None
        first, second, third = (int(p) for p in self.worker_gc_thresholds.split(","))
        return first, second, third

    @field_validator(
        "temporal_tls",
        "temporal_tls_client_cert_path",
        "temporal_tls_client_key_path",
        "temporal_tls_server_ca_cert_path",
        "temporal_tls_server_name",
        "temporal_api_key",
        "temporal_api_key_file",
        "database_pool_size",
        "database_max_overflow",
        "database_pool_timeout_seconds",
        mode="before",
    )
    @classmethod
    def _empty_is_unset(cls, value: object) -> object:
        """`VAR=` in an env file means unset (a path "" would be ".")."""
        return None if isinstance(value, str) and not value.strip() else value

    task_queue: str = "roundtable"
    sweep_enabled: bool = True
    sweep_interval_seconds: int = Field(default=60, ge=5)
    # What a worker process does (README, "Worker roles"): "all" (one worker
    # does everything), "workflows" (runs and bookkeeping, no tool code and
    # no tool credentials) or "tools" (tool calls only).
    worker_role: Literal["all", "workflows", "tools"] = "all"
    # A tool worker serving only these tools (comma-separated); empty: all.
    worker_tools: str = ""
    # The task queue tool workers poll; unset: the main task_queue.
    tool_task_queue: str | None = None
    # The worker's tuning (README, "Worker tuning"); unset: the SDK's default.
    worker_max_concurrent_activities: int | None = Field(default=None, ge=1)
    worker_max_concurrent_local_activities: int | None = Field(default=None, ge=1)
    worker_max_concurrent_workflow_tasks: int | None = Field(default=None, ge=2)
    worker_max_cached_workflows: int | None = Field(default=None, ge=0)
    # How long a dead worker's runs wait on its sticky queue before another
    # worker takes them (the SDK's 10 s lengthens crash → unknown by as much).
    worker_sticky_queue_timeout_seconds: float = Field(default=1.0, gt=0)
    # Python's garbage collector in a worker process (gc.set_threshold).
    # Empty (the default): Python's own (700, 10, 10). Raised thresholds
    # (20000,20,20, the default before) saved a busy worker about 7 ms of
    # CPU a run (a tenth) of full collections, but let garbage pile up
    # between them: its RSS grew about 30 KiB a run, 231 → 439 MB over 7,200
    # runs with no ceiling seen, where Python's own held it at 232 to 256 MB
    # (bench/README, "The worker's memory").
    worker_gc_thresholds: str = ""
    # A run's target lease and heartbeat timeout when its request sets none
    # (README, "Worker tuning"); unset: RunInput's 30 s and 20 s. Applied
    # where runs are started (API, CLI), not to runs started straight
    # through Temporal, which carry their own.
    run_lease_seconds: int | None = Field(default=None, ge=2, le=3600)
    run_heartbeat_timeout_seconds: int | None = Field(default=None, ge=1, le=3600)
    # SIGTERM: writes under way get this long to finish before they are
    # cancelled (then they end unknown, through the normal path).
    shutdown_grace_seconds: float = Field(default=30.0, ge=0)
    # Where the worker serves Prometheus metrics (the Temporal SDK's and
    # ours); empty: none. Several workers on one host need one address each.
    worker_metrics_address: str = "127.0.0.1:9464"
    # How often the worker recounts its gauges (pending approvals, unknown
    # actions) in the database.
    metrics_refresh_seconds: float = Field(default=5, gt=0)
    # The API's /metrics takes an operator token unless this is set (for a
    # scraper on a private network; see the README).
    api_metrics_public: bool = False
    # Tools from MCP servers: a {"mcpServers": ...} JSON file.
    mcp_config: str | None = None
    # Outgoing webhooks: receivers, signing secret (default: derived from the
    # action secret), and how long before a deadline approval.expiring fires.
    webhook_urls: list[str] = Field(default_factory=list)
    webhook_secret: str | None = None
    approval_expiring_lead_seconds: int = Field(default=300, ge=0)
    # Browser origins allowed to call the codec endpoints (the Temporal UI).
    ui_origins: list[str] = Field(
        default_factory=lambda: ["http://127.0.0.1:8233", "http://localhost:8233"]
    )
    # The embedded stack only: serve /codec/ui/{encode,decode} with no token to
    # a browser on this machine showing a page from ui_origins. `temporal
    # server start-dev` takes the UI's codec endpoint only on its command line,
    # where any token would be readable by every local user.
    ui_codec_loopback: bool = False
    demo_ticket_write_delay_seconds: float = Field(default=0.5, ge=0)
    # Where the demo ticket system keeps its tickets: by default beside the
    # store, in its database. A separate database stands in for a customer's
    # system of its own (the benchmarks use one, as the bare baseline does).
    demo_tickets_url: str | None = None
    # Chaos for demos and tests: writes to these demo ticket ids apply, then fail.
    demo_ticket_drop_after_write: list[str] = Field(default_factory=list)
    # Who may ask for what (roundtable/permissions.py). The write policy a run
    # may use is capped by its starter's role; runs started straight through
    # Temporal are held to the service ceiling by the worker.
    policy_ceiling_user: str = "confirm_all_writes"
    policy_ceiling_service: str = "confirm_all_writes"
    policy_ceiling_operator: str = "auto_approve_up_to:R1"
    # "owner": a run's owner may decide its approvals; "others": never the
    # person who started the run. Writes at or above operator_approval_risk
    # are decided by operators only.
    approvers: Literal["owner", "others"] = "owner"
    operator_approval_risk: Literal["R0", "R1", "R2", "R3", "none"] = "R3"
    # Models a run may name; empty: "scripted" and default_model.
    allowed_models: list[str] = Field(default_factory=list)
    default_model: str | None = None
    # Approval extensions are bounded, so an approval cannot be kept open for
    # ever by extending it again and again: at most this many extensions, and
    # never past this long after the approval was created (refused with 409).
    max_approval_extensions: int = Field(default=3, ge=0)
    max_approval_total_seconds: int = Field(default=7 * 24 * 3600, gt=0)
    # The approvals inbox (/inbox): how long a sign-in lasts, and whether its
    # cookie is sent over HTTPS only (set it wherever the API is served over TLS).
    inbox_session_seconds: int = Field(default=8 * 3600, gt=0)
    inbox_cookie_secure: bool = False

    @model_validator(mode="after")
    def _heartbeat_inside_lease(self) -> Settings:
        from roundtable.models import RunInput  # the request's own defaults

        fields = RunInput.model_fields
        lease = self.run_lease_seconds or fields["lease_seconds"].default
        heartbeat = (
            self.run_heartbeat_timeout_seconds or fields["heartbeat_timeout_seconds"].default
        )
        if heartbeat >= lease:
            raise ValueError(
                f"ROUNDTABLE_RUN_HEARTBEAT_TIMEOUT_SECONDS ({heartbeat}) must be shorter than "
                f"ROUNDTABLE_RUN_LEASE_SECONDS ({lease}): a lost worker is noticed by its "
                "heartbeat before its lease runs out"
            )
        return self

    def database_pool(self) -> PoolSizing:
        """The store's PostgreSQL pool as set (``database_pool_*``)."""
        return PoolSizing(
            self.database_pool_size,
            self.database_max_overflow,
            self.database_pool_timeout_seconds,
        )

    def tool_queue(self) -> str:
        """The task queue tool calls go to when tool workers serve them."""
        return self.tool_task_queue or self.task_queue

    def served_tools(self) -> list[str]:
        """The tools a tool worker is limited to (``worker_tools``); empty: all."""
        return [name.strip() for name in self.worker_tools.split(",") if name.strip()]

    def tickets_url(self) -> str:
        """The demo ticket system's database (see demo_tickets_url)."""
        return self.demo_tickets_url or self.database_url


def load_settings() -> Settings:
    return Settings()


DEV_SECRET_FILE = DEFAULT_STATE_DIR / "dev-secret"
SECRET_ENV_VAR = "ROUNDTABLE_ACTION_SECRET_KEY"  # noqa: S105 (a variable name, not a secret)


def adopt_dev_secret() -> bool:
    """In a checkout where `roundtable dev` ran, use its secret when none is set,
    so commands typed in another terminal can encrypt what they send."""
    if os.environ.get(SECRET_ENV_VAR, "").strip() or not DEV_SECRET_FILE.is_file():
        return False
    os.environ[SECRET_ENV_VAR] = DEV_SECRET_FILE.read_text().strip()
    return True
