"""Connecting to Temporal the one way every entry point does."""

from __future__ import annotations

from temporalio.api.enums.v1 import IndexedValueType
from temporalio.api.operatorservice.v1 import AddSearchAttributesRequest
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter

WORKFLOW_NAME = "RoundtableWorkflow"
SWEEP_SCHEDULE_ID = "roundtable-sweep"

SEARCH_ATTRIBUTE_TYPES = {
    "RoundtableStatus": IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD,
    "RoundtableUserId": IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD,
    "RoundtablePendingApprovals": IndexedValueType.INDEXED_VALUE_TYPE_INT,
    "RoundtableUnknownActions": IndexedValueType.INDEXED_VALUE_TYPE_INT,
}
# As `temporal server start-dev --search-attribute NAME=Type` spells them.
SEARCH_ATTRIBUTE_FLAGS = {
    "RoundtableStatus": "Keyword",
    "RoundtableUserId": "Keyword",
    "RoundtablePendingApprovals": "Int",
    "RoundtableUnknownActions": "Int",
}


async def connect(address: str, namespace: str) -> Client:
    return await Client.connect(
        address, namespace=namespace, data_converter=pydantic_data_converter
    )


async def register_search_attributes(client: Client) -> None:
    """For servers started without them (the time-skipping test server)."""
    await client.operator_service.add_search_attributes(
        AddSearchAttributesRequest(
            namespace=client.namespace, search_attributes=SEARCH_ATTRIBUTE_TYPES
        )
    )
