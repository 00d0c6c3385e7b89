"""Connecting to Temporal the one way every entry point does: pydantic data
converter, payloads encrypted by the Roundtable codec."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from pydantic import TypeAdapter
from temporalio.api.common.v1 import Payload
from temporalio.api.enums.v1 import IndexedValueType
from temporalio.api.operatorservice.v1 import AddSearchAttributesRequest
from temporalio.client import Client
from temporalio.contrib.pydantic import (
    PydanticJSONPlainPayloadConverter,
    pydantic_data_converter,
)
from temporalio.converter import (
    CompositePayloadConverter,
    DataConverter,
    DefaultFailureConverterWithEncodedAttributes,
    DefaultPayloadConverter,
    JSONPlainPayloadConverter,
)
from temporalio.runtime import Runtime

from roundtable.codec import EncryptionCodec, keys_from_environment
from roundtable.names import SEARCH_ATTRIBUTES
from roundtable.telemetry.tracing import temporal_interceptors

_INDEXED_TYPES = {
    "Keyword": IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD,
    "Int": IndexedValueType.INDEXED_VALUE_TYPE_INT,
}
SEARCH_ATTRIBUTE_TYPES = {name: _INDEXED_TYPES[kind] for name, kind in SEARCH_ATTRIBUTES.items()}


# One cache of pydantic TypeAdapters for the whole process. The SDK builds a
# payload converter for every workflow run it starts (inside the sandbox), and
# pydantic's converter keeps its adapters per instance: every run would build
# the adapters for its arguments, state and results again (CPU at every
# start, memory for every cached run). Adapters are pure validators; bounded.
_SHARED_ADAPTERS = functools.lru_cache(maxsize=1024)(TypeAdapter)


class _SharedAdapterJSONConverter(PydanticJSONPlainPayloadConverter):
    """pydantic's JSON converter, validating through the process-wide cache."""

    def from_payload(self, payload: Payload, type_hint: type | None = None) -> Any:
        hint = type_hint if type_hint is not None else Any
        try:
            adapter = _SHARED_ADAPTERS(hint)
        except TypeError:  # an unhashable hint: not cached
            adapter = TypeAdapter(hint)
        return adapter.validate_json(payload.data)


class SharedAdapterPayloadConverter(CompositePayloadConverter):
    """The SDK's default converters, JSON through the converter above (as
    temporalio.contrib.pydantic's PydanticPayloadConverter builds its own)."""

    def __init__(self) -> None:
        json_converter = _SharedAdapterJSONConverter()
        super().__init__(
            *(
                json_converter if isinstance(c, JSONPlainPayloadConverter) else c
                for c in DefaultPayloadConverter.default_encoding_payload_converters
            )
        )


def data_converter(codec: EncryptionCodec | None = None) -> DataConverter:
    """Pydantic models in, ciphertext out. Keys from the environment by default.
    Failure messages and stack traces are encrypted too: an error can quote
    what it failed on (a validation message quoting an edited argument)."""
    codec = codec or EncryptionCodec(keys_from_environment())
    return dataclasses.replace(
        pydantic_data_converter,
        payload_converter_class=SharedAdapterPayloadConverter,
        payload_codec=codec,
        failure_converter_class=DefaultFailureConverterWithEncodedAttributes,
    )


async def connect(
    address: str, namespace: str, runtime: Runtime | None = None, tracing: bool = False
) -> Client:
    """A client with our payload codec; ``runtime`` (default: the SDK's) is
    where its workers' metrics go; ``tracing``: spans for it and its workers."""
    return await Client.connect(
        address,
        namespace=namespace,
        data_converter=data_converter(),
        runtime=runtime,
        interceptors=temporal_interceptors(tracing),
    )


async def register_search_attributes(client: Client) -> None:
    """For servers started without them (the time-skipping test server)."""
    await client.operator_service.add_search_attributes(
        AddSearchAttributesRequest(
            namespace=client.namespace, search_attributes=SEARCH_ATTRIBUTE_TYPES
        )
    )
