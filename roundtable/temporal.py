"""Connecting to Temporal the one way every entry point does: pydantic data
converter, payloads encrypted by the Roundtable codec."""

from __future__ import annotations

import dataclasses

from temporalio.api.enums.v1 import IndexedValueType
from temporalio.api.operatorservice.v1 import AddSearchAttributesRequest
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.converter import DataConverter, DefaultFailureConverterWithEncodedAttributes

from roundtable.codec import EncryptionCodec, keys_from_environment
from roundtable.names import SEARCH_ATTRIBUTES

_INDEXED_TYPES = {
    "Keyword": IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD,
    "Int": IndexedValueType.INDEXED_VALUE_TYPE_INT,
}
SEARCH_ATTRIBUTE_TYPES = {name: _INDEXED_TYPES[kind] for name, kind in SEARCH_ATTRIBUTES.items()}


def data_converter(codec: EncryptionCodec | None = None) -> DataConverter:
    """Pydantic models in, ciphertext out. Keys from the environment by default.
    Failure messages and stack traces are encrypted too: an error can quote
    what it failed on (a validation message quoting an edited argument)."""
    codec = codec or EncryptionCodec(keys_from_environment())
    return dataclasses.replace(
        pydantic_data_converter,
        payload_codec=codec,
        failure_converter_class=DefaultFailureConverterWithEncodedAttributes,
    )


async def connect(address: str, namespace: str) -> Client:
    return await Client.connect(address, namespace=namespace, data_converter=data_converter())


async def register_search_attributes(client: Client) -> None:
    """For servers started without them (the time-skipping test server)."""
    await client.operator_service.add_search_attributes(
        AddSearchAttributesRequest(
            namespace=client.namespace, search_attributes=SEARCH_ATTRIBUTE_TYPES
        )
    )
