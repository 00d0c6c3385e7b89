"""Temporal payload encryption: what the Temporal server stores is ciphertext.

AES-GCM with a 256-bit key derived (HKDF) from a secret; each payload names
its key id in the metadata. Encoding uses the first key; decoding accepts any
known key. Rotation takes two phases (README, "Payload keys"): first add the
new key *second* everywhere (every process can read it, none writes it yet),
then move it first; keep the old key until no open history needs it.
Payloads that were never encrypted decode as they are.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
from collections.abc import Sequence

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from temporalio.api.common.v1 import Payload
from temporalio.converter import PayloadCodec
from temporalio.runtime import Runtime

from roundtable.security import SECRET_ENV_VAR, ActionSecretKeyError

ENCODING = b"binary/encrypted"
KEY_ID = "encryption-key-id"
KEYS_ENV_VAR = "ROUNDTABLE_PAYLOAD_KEYS"
DEFAULT_KEY_ID = "action-secret"
_LABEL = b"roundtable/payload-codec/aes-gcm/v1"
log = logging.getLogger("roundtable.codec")
_NONCE = 12


class PayloadKeyError(ValueError):
    code = "payload_key_error"


def derive_payload_key(secret: str) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_LABEL).derive(
        secret.encode()
    )


def keys_from_environment() -> list[tuple[str, bytes]]:
    """``ROUNDTABLE_PAYLOAD_KEYS=kid2=secret2,kid1=secret1`` (first encodes), or
    one key derived from the action secret. No secret at all: fail closed."""
    configured = os.environ.get(KEYS_ENV_VAR, "").strip()
    if configured:
        keys = []
        for item in configured.split(","):
            key_id, sep, secret = item.strip().partition("=")
            if not sep or not key_id or not secret:
                raise PayloadKeyError(f"{KEYS_ENV_VAR} entries look like key_id=secret")
            keys.append((key_id, derive_payload_key(secret)))
        return keys
    secret = os.environ.get(SECRET_ENV_VAR, "").strip()
    if not secret:
        raise ActionSecretKeyError(
            f"set {KEYS_ENV_VAR} or {SECRET_ENV_VAR}: Temporal payloads are always encrypted"
        )
    return [(DEFAULT_KEY_ID, derive_payload_key(secret))]


_MISSING_KEYS_SEEN: set[str] = set()
_MAX_MISSING_KEYS = 32
MISSING_KEY_METRIC = "roundtable_payload_key_missing"


def report_missing_key(key_id: str) -> None:
    """A payload sealed under a key this process lacks. Temporal retries the
    workflow task that needs it forever, showing the run as running: say so
    once per key id in the log, and count every time in the metrics."""
    if key_id not in _MISSING_KEYS_SEEN and len(_MISSING_KEYS_SEEN) >= _MAX_MISSING_KEYS:
        key_id = "other"  # bounded: the codec endpoint hears key ids from callers
    if key_id not in _MISSING_KEYS_SEEN:
        _MISSING_KEYS_SEEN.add(key_id)
        log.error(
            "a Temporal payload is sealed with key id %r, which this process does not "
            "have; runs that need it cannot proceed. Add the key to %s.",
            key_id,
            KEYS_ENV_VAR,
        )
    with contextlib.suppress(Exception):  # metrics never stop decoding
        Runtime.default().metric_meter.create_counter(
            MISSING_KEY_METRIC, "payloads that could not be decrypted: key id unknown"
        ).add(1, {"key_id": key_id})


class EncryptionCodec(PayloadCodec):
    def __init__(self, keys: Sequence[tuple[str, bytes]]) -> None:
        if not keys:
            raise PayloadKeyError("the codec needs at least one key")
        self.encode_key_id = keys[0][0]
        self._ciphers = {key_id: AESGCM(key) for key_id, key in keys}

    async def encode(self, payloads: Sequence[Payload]) -> list[Payload]:
        cipher = self._ciphers[self.encode_key_id]
        sealed = []
        for payload in payloads:
            nonce = secrets.token_bytes(_NONCE)
            data = cipher.encrypt(nonce, payload.SerializeToString(), self.encode_key_id.encode())
            sealed.append(
                Payload(
                    metadata={"encoding": ENCODING, KEY_ID: self.encode_key_id.encode()},
                    data=nonce + data,
                )
            )
        return sealed

    async def decode(self, payloads: Sequence[Payload]) -> list[Payload]:
        opened = []
        for payload in payloads:
            if payload.metadata.get("encoding") != ENCODING:
                opened.append(payload)
                continue
            key_id = _key_id_of(payload)
            cipher = self._ciphers.get(key_id)
            if cipher is None:
                report_missing_key(key_id)
                raise PayloadKeyError(
                    f"no key {key_id!r} to decrypt this payload: add it to {KEYS_ENV_VAR} "
                    "(after the key that encodes) on every worker and client"
                )
            if len(payload.data) <= _NONCE:
                raise PayloadKeyError("payload too short to be sealed")
            try:
                plain = cipher.decrypt(
                    payload.data[:_NONCE], payload.data[_NONCE:], key_id.encode()
                )
                opened.append(Payload.FromString(plain))
            except (InvalidTag, ValueError) as exc:  # protobuf's DecodeError is a ValueError
                raise PayloadKeyError("payload failed authentication") from exc
        return opened


def _key_id_of(payload: Payload) -> str:
    """The key id a payload names. The codec endpoint takes payloads from
    anyone holding a codec token: a key id that is not one we could have
    written is refused before it reaches a log line or a metric label."""
    raw = payload.metadata.get(KEY_ID, b"")
    try:
        key_id = raw.decode()
    except UnicodeDecodeError:
        raise PayloadKeyError("payload names a key id that is not text") from None
    if len(key_id) > 64 or not key_id.isprintable():
        raise PayloadKeyError("payload names a key id no key could have")
    return key_id
