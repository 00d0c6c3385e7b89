"""Connecting to Temporal the one way every entry point does: the cluster the
settings name (TLS, client certificate, API key), pydantic data converter,
payloads encrypted by the Roundtable codec."""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from pydantic import SecretStr, TypeAdapter
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
    EncodingPayloadConverter,
    JSONPlainPayloadConverter,
)
from temporalio.runtime import Runtime
from temporalio.service import TLSConfig

from roundtable.codec import EncryptionCodec, keys_from_environment
from roundtable.config import Settings
from roundtable.names import SEARCH_ATTRIBUTES
from roundtable.telemetry.tracing import temporal_interceptors

_INDEXED_TYPES = {
    "Keyword": IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD,
    "Int": IndexedValueType.INDEXED_VALUE_TYPE_INT,
}
log = logging.getLogger(__name__)

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
    temporalio.contrib.pydantic's PydanticPayloadConverter builds its own).

    The SDK builds one of these for every workflow activation and activity it
    runs; all of them share one read-only table of converters, built once
    (none keeps state of its own: the JSON one validates through the shared
    adapters), where each used to build its own."""

    def __init__(self) -> None:
        self.converters = _shared_converters()


@functools.cache
def _shared_converters() -> Mapping[bytes, EncodingPayloadConverter]:
    json_converter = _SharedAdapterJSONConverter()
    chosen = (
        json_converter if isinstance(c, JSONPlainPayloadConverter) else c
        for c in DefaultPayloadConverter.default_encoding_payload_converters
    )
    return MappingProxyType({c.encoding.encode(): c for c in chosen})


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


class TemporalSettingsError(ValueError):
    """Temporal connection settings that cannot work. The message names the
    variables and paths at fault, never a key or a file's contents."""


_CLOUD_HOSTS = (".tmprl.cloud", ".api.temporal.io")
_VAR = "ROUNDTABLE_TEMPORAL_"
# The variables that make a connection TLS; `roundtable dev` drops them (its
# own server is plain).
SECURITY_VARIABLES = tuple(
    f"ROUNDTABLE_{name.upper()}"
    for name in Settings.model_fields
    if name.startswith(("temporal_tls", "temporal_api_key"))
)


@dataclasses.dataclass(frozen=True, repr=False)
class TemporalConnection:
    """Where and how to connect, checked, with the files read. Its repr and
    :meth:`describe` show no secret; :meth:`client_options` hands them over."""

    address: str
    namespace: str
    tls: bool | TLSConfig  # a TLSConfig holds the client's private key
    api_key: SecretStr | None = None

    def client_options(self) -> dict[str, Any]:
        """The connection part of ``Client.connect``'s arguments."""
        return {
            "target_host": self.address,
            "namespace": self.namespace,
            "tls": self.tls,
            "api_key": self.api_key.get_secret_value() if self.api_key else None,
        }

    def describe(self) -> str:
        """For logs and messages: what is used, never what it holds."""
        how = []
        if isinstance(self.tls, TLSConfig):
            how.append("TLS")
            if self.tls.client_cert is not None:
                how.append("client certificate")
            if self.tls.server_root_ca_cert is not None:
                how.append("CA from file")
            if self.tls.domain is not None:
                how.append(f"server name {self.tls.domain}")
        elif self.tls:
            how.append("TLS")
        else:
            how.append("plain")
        if self.api_key is not None:
            how.append("API key")
        return f"{self.address} namespace {self.namespace} ({', '.join(how)})"

    def __repr__(self) -> str:
        return f"TemporalConnection({self.describe()})"


def temporal_connection(settings: Settings) -> TemporalConnection:
    """The connection the settings describe, or TemporalSettingsError saying
    which settings to change. Every entry point connects through this (by way
    of :func:`connect`), so none can forget TLS or the key."""
    cert_path = settings.temporal_tls_client_cert_path
    key_path = settings.temporal_tls_client_key_path
    ca_path = settings.temporal_tls_server_ca_cert_path
    server_name = settings.temporal_tls_server_name
    if (cert_path is None) != (key_path is None):
        given, missing = (
            ("CLIENT_CERT", "CLIENT_KEY") if key_path is None else ("CLIENT_KEY", "CLIENT_CERT")
        )
        raise TemporalSettingsError(
            f"{_VAR}TLS_{given}_PATH is set without {_VAR}TLS_{missing}_PATH: "
            "a client certificate needs its private key, and the key its certificate"
        )
    if settings.temporal_api_key is not None and settings.temporal_api_key_file is not None:
        raise TemporalSettingsError(f"both {_VAR}API_KEY and {_VAR}API_KEY_FILE are set: set one")
    has_key = settings.temporal_api_key is not None or settings.temporal_api_key_file is not None
    if has_key and cert_path is not None:
        raise TemporalSettingsError(
            f"an API key ({_VAR}API_KEY or _API_KEY_FILE) and a client certificate "
            f"({_VAR}TLS_CLIENT_CERT_PATH) are both set: a connection authenticates with "
            "one of them; unset the other"
        )
    tls_material = {
        f"{_VAR}TLS_CLIENT_CERT_PATH": cert_path,
        f"{_VAR}TLS_SERVER_CA_CERT_PATH": ca_path,
        f"{_VAR}TLS_SERVER_NAME": server_name,
    }
    if settings.temporal_tls is False:
        if has_key:
            raise TemporalSettingsError(
                f"{_VAR}TLS=false, but an API key is set: the key would cross the network "
                f"in clear; an API key needs TLS (unset {_VAR}TLS)"
            )
        conflicting = [name for name, value in tls_material.items() if value is not None]
        if conflicting:
            raise TemporalSettingsError(
                f"{_VAR}TLS=false conflicts with {', '.join(conflicting)}: "
                f"unset them, or unset {_VAR}TLS"
            )
    tls_on = (
        settings.temporal_tls is True
        or has_key
        or any(value is not None for value in tls_material.values())
    )
    host = settings.temporal_address.rpartition(":")[0] or settings.temporal_address
    if not tls_on and host.lower().endswith(_CLOUD_HOSTS):
        raise TemporalSettingsError(
            f"{settings.temporal_address} is Temporal Cloud, which takes TLS only: set "
            f"{_VAR}API_KEY_FILE (or _API_KEY), or {_VAR}TLS_CLIENT_CERT_PATH and "
            "_CLIENT_KEY_PATH"
        )
    tls: bool | TLSConfig = tls_on
    if cert_path is not None or ca_path is not None or server_name is not None:
        tls = TLSConfig(
            client_cert=_pem(f"{_VAR}TLS_CLIENT_CERT_PATH", cert_path, b"CERTIFICATE-----"),
            client_private_key=_pem(f"{_VAR}TLS_CLIENT_KEY_PATH", key_path, b"PRIVATE KEY-----"),
            server_root_ca_cert=_pem(
                f"{_VAR}TLS_SERVER_CA_CERT_PATH", ca_path, b"CERTIFICATE-----"
            ),
            domain=server_name,
        )
    return TemporalConnection(
        settings.temporal_address, settings.temporal_namespace, tls, _api_key(settings)
    )


def _read(variable: str, path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:  # the reason, never the contents
        raise TemporalSettingsError(
            f"cannot read {variable} ({path}): {exc.strerror or type(exc).__name__}"
        ) from None


def _pem(variable: str, path: Path | None, marker: bytes) -> bytes | None:
    """The file's bytes, if it holds the PEM block it should (a certificate
    and its key swapped fail here, by name, not deep in the TLS stack)."""
    if path is None:
        return None
    data = _read(variable, path)
    if b"-----BEGIN " not in data or marker not in data:
        kind = "private key" if marker.startswith(b"PRIVATE") else "certificate"
        raise TemporalSettingsError(f"{variable} ({path}) holds no PEM {kind}")
    return data


def _api_key(settings: Settings) -> SecretStr | None:
    if settings.temporal_api_key is not None:
        key, source = settings.temporal_api_key.get_secret_value().strip(), f"{_VAR}API_KEY"
    elif settings.temporal_api_key_file is not None:
        path = settings.temporal_api_key_file
        source = f"{_VAR}API_KEY_FILE ({path})"
        try:
            key = _read(f"{_VAR}API_KEY_FILE", path).decode().strip()
        except UnicodeDecodeError:
            raise TemporalSettingsError(f"{source} is not text") from None
    else:
        return None
    if not key:
        raise TemporalSettingsError(f"{source} is empty")
    if any(c in key for c in "\r\n\0"):  # it becomes an HTTP header
        raise TemporalSettingsError(f"{source} must hold the key on one line")
    return SecretStr(key)


async def connect(
    settings: Settings, *, runtime: Runtime | None = None, tracing: bool = False
) -> Client:
    """A client for the cluster the settings name (TLS, client certificate
    and API key included) with our payload codec; ``runtime`` (default: the
    SDK's) is where its workers' metrics go; ``tracing``: spans for it and its
    workers. Raises TemporalSettingsError before any network call when the
    settings cannot work."""
    connection = temporal_connection(settings)
    log.debug("connecting to Temporal at %s", connection.describe())
    return await Client.connect(
        **connection.client_options(),
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
