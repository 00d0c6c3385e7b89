"""How long the workflows give each kind of activity, and how they retry."""

from __future__ import annotations

from datetime import timedelta

from temporalio.common import RetryPolicy

from roundtable.names import WEBHOOK_REJECTED

BOOKKEEPING = timedelta(seconds=30)  # local activities against the store
MODEL_CALL = timedelta(minutes=5)
TOOL_CALL = timedelta(minutes=10)
# A busy target is tried again on a durable timer, backing off to a cap
# (longer when it waits for a person to reconcile an unknown action).
RETRY_BUSY_FIRST, RETRY_BUSY_MAX = timedelta(seconds=1), timedelta(minutes=1)
RETRY_BLOCKED_MAX = timedelta(minutes=5)
ONCE = RetryPolicy(maximum_attempts=1)  # writes: never run twice
# How long a tool call waits for a tool worker to take it before the run
# says that none serves the tool (and schedules it again: it never started),
# each wait twice the last up to the cap (about 5 history events a wait).
TOOL_WORKER_WAIT, TOOL_WORKER_WAIT_MAX = timedelta(seconds=60), timedelta(minutes=15)
# A message handler's step waits less: its caller is waiting, and the
# attestation of who decided ages (permissions.MAX_ATTESTATION_AGE).
HANDLER_TOOL_WORKER_WAIT = timedelta(seconds=10)
WEBHOOK_RETRIES = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    backoff_coefficient=2.0,
    maximum_interval=timedelta(minutes=5),
    maximum_attempts=8,
    non_retryable_error_types=(WEBHOOK_REJECTED,),
)
