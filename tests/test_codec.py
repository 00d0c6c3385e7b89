"""Payload encryption: the Temporal server holds ciphertext; the codec endpoint
gives operators the plaintext back, and nobody else."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
from google.protobuf.json_format import MessageToDict
from temporalio.api.common.v1 import Payload, Payloads
from temporalio.client import Client

from roundtable.codec import EncryptionCodec, PayloadKeyError, derive_payload_key
from tests.api_server import serve_api
from tests.workflow_harness import harness, script, ticket_call

CANARY = "CANARY-7c0ffee-do-not-leak"


def plain(text: str) -> Payload:
    return Payload(metadata={"encoding": b"json/plain"}, data=json.dumps(text).encode())


def mentions(document: Any, needle: str) -> bool:
    """Is ``needle`` anywhere in a JSON document, as text or inside base64?"""
    if isinstance(document, dict):
        return any(mentions(v, needle) for v in document.values())
    if isinstance(document, list):
        return any(mentions(v, needle) for v in document)
    if isinstance(document, str):
        if needle in document:
            return True
        try:
            return needle.encode() in base64.b64decode(document, validate=True)
        except ValueError:
            return False
    return False


async def test_round_trip_rotation_and_tampering() -> None:
    old = EncryptionCodec([("k1", derive_payload_key("first secret"))])
    rotated = EncryptionCodec(
        [("k2", derive_payload_key("second secret")), ("k1", derive_payload_key("first secret"))]
    )
    (sealed_old,) = await old.encode([plain(CANARY)])
    assert CANARY.encode() not in sealed_old.data
    assert sealed_old.metadata["encryption-key-id"] == b"k1"
    assert (await rotated.decode([sealed_old]))[0] == plain(CANARY)
    (sealed_new,) = await rotated.encode([plain(CANARY)])
    assert sealed_new.metadata["encryption-key-id"] == b"k2"
    with pytest.raises(PayloadKeyError, match="no key"):
        await old.decode([sealed_new])
    tampered = Payload()
    tampered.CopyFrom(sealed_new)
    tampered.data = sealed_new.data[:-1] + bytes([sealed_new.data[-1] ^ 1])
    with pytest.raises(PayloadKeyError, match="authentication"):
        await rotated.decode([tampered])
    assert await rotated.decode([plain("x")]) == [plain("x")]  # never encrypted: as is


async def test_canary_is_ciphertext_in_temporal_and_readable_through_the_codec(tmp_path) -> None:
    calls = [ticket_call("ticket_update", fields={"note": CANARY})]
    async with harness(tmp_path) as h, serve_api(h) as api:
        handle = await h.start(
            task_text="t", script=script(("seat-1", 1, calls)), write_policy="auto_approve_up_to:R3"
        )
        await handle.result()

        raw_client = await Client.connect(
            h.client.service_client.config.target_host, namespace=h.client.namespace
        )
        raw = await raw_client.get_workflow_handle(handle.id).fetch_history()
        history = json.loads(raw.to_json())
        assert not mentions(history, CANARY), "the canary reached Temporal in plaintext"

        started = raw.events[0].workflow_execution_started_event_attributes
        body = MessageToDict(Payloads(payloads=list(started.input.payloads)))
        assert (
            body["payloads"][0]["metadata"]["encoding"]
            == base64.b64encode(b"binary/encrypted").decode()
        )
        decoded = await api.http.post("/codec/decode", json=body, headers=api.auth("ops"))
        assert decoded.status_code == 200, decoded.text
        assert mentions(decoded.json(), CANARY)

        assert (await api.http.post("/codec/decode", json=body)).status_code == 401
        assert (
            await api.http.post("/codec/decode", json=body, headers=api.auth("alice"))
        ).status_code == 403
        garbage = await api.http.post(
            "/codec/decode", json={"payloads": "no"}, headers=api.auth("ops")
        )
        assert garbage.status_code == 422
        encoded = await api.http.post(
            "/codec/encode",
            json=MessageToDict(Payloads(payloads=[plain("hi")])),
            headers=api.auth("ops"),
        )
        assert encoded.status_code == 200 and not mentions(encoded.json(), '"hi"')
        preflight = await api.http.options(
            "/codec/decode",
            headers={
                "Origin": "http://localhost:8233",
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization",
            },
        )
        assert preflight.headers["access-control-allow-origin"] == "http://localhost:8233"


async def test_malformed_sealed_payloads_are_refused_not_500s() -> None:
    """Anyone with the UI's codec token can send these; each was a 500."""
    from temporalio.api.common.v1 import Payload

    codec = EncryptionCodec([("k1", derive_payload_key("a secret"))])
    sealed = b"binary/encrypted"
    for key_id, data in (
        (b"k1", b""),  # shorter than a nonce
        (b"k1", b"0" * 40),  # not a ciphertext of ours
        (b"\xff\xfe", b"0" * 40),  # a key id that is not text
        (b"x" * 500, b"0" * 40),  # a key id no key could have
    ):
        bad = Payload(metadata={"encoding": sealed, "encryption-key-id": key_id}, data=data)
        with pytest.raises(PayloadKeyError):
            await codec.decode([bad])


def test_every_payload_converter_shares_one_cache_of_type_adapters() -> None:
    """The SDK makes a converter for every run it starts; the adapters that
    validate our models are built once per process, not once per run."""
    from roundtable.models import Decision
    from roundtable.temporal import _SHARED_ADAPTERS, SharedAdapterPayloadConverter

    decision = Decision(approval_id="a-1", decision="approved", decided_by="op")
    first, second = SharedAdapterPayloadConverter(), SharedAdapterPayloadConverter()
    (payload,) = first.to_payloads([decision])
    assert first.from_payloads([payload], [Decision]) == [decision]
    built = _SHARED_ADAPTERS.cache_info().currsize
    assert second.from_payloads([payload], [Decision]) == [decision]
    assert _SHARED_ADAPTERS.cache_info().currsize == built  # reused, not rebuilt
    assert _SHARED_ADAPTERS.cache_info().hits >= 1
    # One table of converters for all, which nobody can change.
    assert first.converters is second.converters
    with pytest.raises(TypeError):
        first.converters[b"json/plain"] = None  # type: ignore[index]


def test_a_payload_converter_with_a_context_is_a_converter_of_its_own() -> None:
    """The SDK gives a converter a serialization context by building a new
    one with the converters the context changed (its constructor takes no
    arguments): that one gets its own table, and the shared one is left as
    it was."""
    from temporalio.converter import (
        EncodingPayloadConverter,
        WithSerializationContext,
        WorkflowSerializationContext,
    )

    from roundtable.temporal import SharedAdapterPayloadConverter

    class Contextual(EncodingPayloadConverter, WithSerializationContext):
        def __init__(self, seen: object = None) -> None:
            self.seen = seen

        @property
        def encoding(self) -> str:
            return "test/contextual"

        def to_payload(self, value: Any) -> Payload | None:
            return None

        def from_payload(self, payload: Payload, type_hint: Any = None) -> Any:
            return self.seen

        def with_context(self, context: Any) -> Contextual:
            return Contextual(context)

    base = SharedAdapterPayloadConverter()
    shared = base.converters
    base._set_converters(*shared.values(), Contextual())  # as a subclass might
    context = WorkflowSerializationContext(namespace="n", workflow_id="w")
    tuned = base.with_context(context)
    assert tuned is not base and tuned.converters[b"test/contextual"].seen == context
    assert SharedAdapterPayloadConverter().converters is shared
    assert b"test/contextual" not in shared
