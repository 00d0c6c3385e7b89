"""Every name that crosses a process boundary, defined once.

Workflow, update, signal and query names; the failure types the worker raises
and callers branch on; the search attributes SREs filter by. The workflow
declares its handlers with these names, and callers that may not import the
workflow (the CLI, the API, the typed client, activities: layering forbids
it) use them instead of repeating strings. Changing one breaks running
workflows and scripts: add, never rename.
"""

from __future__ import annotations

import re
from types import MappingProxyType

# Workflows, and the schedule that starts the sweep.
RUN_WORKFLOW = "RoundtableWorkflow"
RECONCILE_WORKFLOW = "RoundtableReconcileWorkflow"
SWEEP_SCHEDULE_ID = "roundtable-sweep"

# RoundtableWorkflow's messages.
DECIDE_UPDATE = "decide_approval"
EXTEND_UPDATE = "extend_approval"
RECONCILE_UPDATE = "reconcile_action"
DECISION_SIGNAL = "approval_decision"  # raw signal, for `temporal workflow signal`
RECONCILE_SIGNAL = "reconcile_action_signal"
REFRESH_SIGNAL = "refresh"  # "the store changed under you: look again"
STATE_QUERY = "state"
# An update sent for a caller's request under an Idempotency-Key is named
# "<request>/<attempt>" (operations.attempt_of): each attempt is an update
# of its own (a refusal of one is never the answer to the next), and the
# workflow records the change under the request, so the attempts of one
# request apply it once. Only ids of exactly this form are attempts: the
# SDK's own, and any other a caller chooses, are each their own request.
REQUEST_ATTEMPT_SEPARATOR = "/"
KEYED_ATTEMPT = re.compile(r"((?:decide|extend)-[0-9a-f]{64})/[0-9a-f]{32}")

# ApplicationError types: the worker raises them, callers map them to errors.
CONFLICT = "Conflict"
NOT_FOUND = "NotFound"
INVALID_INPUT = "InvalidInput"
FORBIDDEN_PREFIX = "Forbidden."  # + the permission's code, e.g. Forbidden.operator_required
# The update validator's answer when the run does not track an unknown
# action: the caller reconciles it in the store instead.
NOT_TRACKED = "NotTracked"
ATTEMPT_MAY_BE_RUNNING = "AttemptMayBeRunning"  # details: [retry_at ISO 8601]
WEBHOOK_REJECTED = "WebhookRejected"  # a receiver refused for good: not retried
# No tool worker took a message handler's tool activity (worker roles): nothing done.
NO_TOOL_WORKER = "NoToolWorker"

# Custom search attributes, name → type as `temporal operator search-attribute
# create` and `temporal server start-dev --search-attribute` spell it.
# deploy/temporal-init.sh lists the same (tests/test_names.py checks it).
SEARCH_ATTRIBUTES = MappingProxyType(
    {
        "RoundtableStatus": "Keyword",
        "RoundtableUserId": "Keyword",
        "RoundtablePendingApprovals": "Int",
        "RoundtableUnknownActions": "Int",
    }
)
