"""Roundtable's own metrics, recorded through the Temporal SDK's meter.

The worker's Temporal runtime serves Prometheus (``temporalio.runtime.
PrometheusConfig``) on ``ROUNDTABLE_WORKER_METRICS_ADDRESS``; recording ours on
the same meter puts the SDK's metrics and ours behind one address. Without a
runtime that exports (tests, tools) the meter is a no-op.

The names are a contract: dashboards and alerts use them (``deploy/``), and
tests/test_metrics.py checks each one. Gauges are counts read from the
database, so they are right after a restart and agree between workers (take
their ``max`` across workers, never their ``sum``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from temporalio.common import MetricMeter

from roundtable.store.commit_notes import ActionEnded, ApprovalSettled, LeaseBusy, Note

ACTIONS_TOTAL = "roundtable_actions_total"
APPROVALS_PENDING = "roundtable_approvals_pending"
UNKNOWN_ACTIONS = "roundtable_unknown_actions"
APPROVAL_WAIT_SECONDS = "roundtable_approval_wait_seconds"
TOOL_CALL_SECONDS = "roundtable_tool_call_seconds"
LEASE_BUSY_TOTAL = "roundtable_lease_busy_total"
MODEL_TOKENS_TOTAL = "roundtable_model_tokens_total"

# Histogram buckets (seconds), given to PrometheusConfig by metric name:
# approvals wait minutes to days; tool calls take milliseconds to minutes.
BUCKETS: Mapping[str, Sequence[float]] = {
    APPROVAL_WAIT_SECONDS: (1, 10, 30, 60, 300, 900, 1800, 3600, 4 * 3600, 86400, 7 * 86400),
    TOOL_CALL_SECONDS: (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
}


class Metrics:
    """The instruments, made once per worker from its runtime's meter."""

    def __init__(self, meter: MetricMeter | None = None) -> None:
        meter = meter or MetricMeter.noop
        self._actions = meter.create_counter(
            ACTIONS_TOTAL, "Actions that reached rejected, succeeded, failed or unknown."
        )
        self._pending = meter.create_gauge(APPROVALS_PENDING, "Approvals waiting for a person.")
        self._unknown = meter.create_gauge(
            UNKNOWN_ACTIONS, "Actions whose outcome is unknown, waiting for reconciliation."
        )
        self._approval_wait = meter.create_histogram_float(
            APPROVAL_WAIT_SECONDS, "From an approval's request to its decision or expiry.", "s"
        )
        self._tool_call = meter.create_histogram_float(
            TOOL_CALL_SECONDS, "One tool call, read or write, as the worker timed it.", "s"
        )
        self._lease_busy = meter.create_counter(
            LEASE_BUSY_TOTAL, "Claims that found their target held or blocked by an unknown."
        )
        self._tokens = meter.create_counter(MODEL_TOKENS_TOTAL, "Model tokens, by kind.")

    def committed(self, notes: Sequence[Note]) -> None:
        """A store observer: what a transaction did, once it committed."""
        for note in notes:
            if isinstance(note, ActionEnded):
                self._actions.add(1, {"tool": note.tool, "status": note.status})
            elif isinstance(note, ApprovalSettled):
                self._approval_wait.record(note.waited_seconds, {"outcome": note.outcome})
            elif isinstance(note, LeaseBusy):
                self._lease_busy.add(1, {"tool": note.tool})

    def tool_call(self, tool: str, status: str, seconds: float) -> None:
        self._tool_call.record(seconds, {"tool": tool, "status": status})

    def model_tokens(self, model: str, prompt: int, completion: int) -> None:
        self._tokens.add(prompt, {"model": model, "kind": "prompt"})
        self._tokens.add(completion, {"model": model, "kind": "completion"})

    def gauges(self, pending_approvals: int, unknown_actions: int) -> None:
        self._pending.set(pending_approvals)
        self._unknown.set(unknown_actions)
