"""Outgoing webhooks: signed JSON a chat-ops bridge can trust in a few lines.

Each request carries ``X-Roundtable-Event``, ``X-Roundtable-Delivery`` (stable
across retries, so receivers can de-duplicate) and ``X-Roundtable-Signature:
t=<unix time>,v1=<hex HMAC-SHA256 of "<t>.<body>">``. Verify with
:func:`verify_signature`; reject old timestamps to stop replays.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from typing import Any
from urllib.parse import urlsplit

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

SIGNATURE_HEADER = "X-Roundtable-Signature"
_LABEL = b"roundtable/webhook-signing/v1"


def signing_key(secret: str) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_LABEL).derive(
        secret.encode()
    )


def sign(key: bytes, body: bytes, timestamp: int | None = None) -> str:
    stamp = int(time.time()) if timestamp is None else timestamp
    digest = hmac.new(key, f"{stamp}.".encode() + body, hashlib.sha256).hexdigest()
    return f"t={stamp},v1={digest}"


def verify_signature(key: bytes, body: bytes, header: str, tolerance_seconds: int = 300) -> bool:
    """True for a genuine, fresh signature (what a receiver should check)."""
    try:
        parts = dict(item.split("=", 1) for item in header.split(","))
        stamp = int(parts["t"])
    except (KeyError, ValueError):
        return False
    if abs(time.time() - stamp) > tolerance_seconds:
        return False
    expected = sign(key, body, stamp).split("v1=", 1)[1]
    return hmac.compare_digest(expected, parts.get("v1", ""))


def body_of(event: dict[str, Any]) -> bytes:
    return json.dumps(event, sort_keys=True, separators=(",", ":"), default=str).encode()


def receiver_label(url: str) -> str:
    """How a receiver is named in logs, history and the delivery log: its
    origin and a short hash. A webhook URL often carries its own secret in
    the path or query (chat-ops hooks do), which must not be written down."""
    parts = urlsplit(url)
    digest = hashlib.sha256(url.encode()).hexdigest()[:8]
    return f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}/… #{digest}"
