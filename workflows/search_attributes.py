"""The custom search attributes SREs filter runs by in the Temporal UI."""

from __future__ import annotations

from types import MappingProxyType

from temporalio.common import SearchAttributeKey

from roundtable.names import SEARCH_ATTRIBUTES

# Read-only: this module serves every run in the worker.
_KEYS = MappingProxyType(
    {"Keyword": SearchAttributeKey.for_keyword, "Int": SearchAttributeKey.for_int}
)


def _key(name: str):  # type: ignore[no-untyped-def]
    return _KEYS[SEARCH_ATTRIBUTES[name]](name)


STATUS = _key("RoundtableStatus")
USER_ID = _key("RoundtableUserId")
PENDING_APPROVALS = _key("RoundtablePendingApprovals")
UNKNOWN_ACTIONS = _key("RoundtableUnknownActions")

ALL = (STATUS, USER_ID, PENDING_APPROVALS, UNKNOWN_ACTIONS)
