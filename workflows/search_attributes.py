"""The custom search attributes SREs filter runs by in the Temporal UI."""

from __future__ import annotations

from temporalio.common import SearchAttributeKey

STATUS = SearchAttributeKey.for_keyword("RoundtableStatus")
USER_ID = SearchAttributeKey.for_keyword("RoundtableUserId")
PENDING_APPROVALS = SearchAttributeKey.for_int("RoundtablePendingApprovals")
UNKNOWN_ACTIONS = SearchAttributeKey.for_int("RoundtableUnknownActions")

ALL = (STATUS, USER_ID, PENDING_APPROVALS, UNKNOWN_ACTIONS)
