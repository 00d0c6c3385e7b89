"""Keys, encryption and public views: everything that keeps secrets secret.

Two keys are derived from ``ROUNDTABLE_ACTION_SECRET_KEY`` with HKDF under
separate labels, so the target-key HMAC and the argument cipher never share
key material. The secret is read at call time: no secret, no keys, no writes.
(Over 400 lines: everything here handles the action secret or what it
protects, and is reviewed as one.)
"""

from __future__ import annotations

import base64
import functools
import hashlib
import hmac
import html
import json
import math
import os
import re
import secrets
import unicodedata
import urllib.parse
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from roundtable.config import SECRET_ENV_VAR

TARGET_KEY_PREFIX = "target:v1:"
SCOPE_KEY_PREFIX = "scope:v1:"
REDACTED = "[redacted]"

_TARGET_KEY_LABEL = b"roundtable/target-key/v1"
_ARGUMENTS_KEY_LABEL = b"roundtable/action-arguments/aes-gcm/v1"
_CIPHERTEXT_PREFIX = "enc:v1"
_NONCE_BYTES = 12

__all__ = [
    "PUBLIC_ACTION_FIELDS",
    "REDACTED",
    "RESULT_VALUE_WITHHELD",
    "ActionSecretKeyError",
    "ArgumentsDecryptionError",
    "CapabilityError",
    "Target",
    "ToolNotGrantedError",
    "ToolNotInSnapshotError",
    "action_to_public_dict",
    "argument_changes",
    "arguments_digest",
    "decrypt_arguments",
    "derive_target",
    "derive_target_key",
    "encrypt_arguments",
    "read_action_secret",
    "redact_arguments",
    "redact_result",
    "redact_text",
    "text_redactor",
]


class ActionSecretKeyError(RuntimeError):
    """No usable action secret: refuse to derive keys or encrypt (fail closed)."""

    code = "action_secret_missing"


class ArgumentsDecryptionError(ValueError):
    """Ciphertext was tampered with, truncated, or sealed under another secret."""

    code = "arguments_decryption_failed"


class CapabilityError(ValueError):
    """The capability snapshot does not allow what was asked."""

    code = "capability_error"


class ToolNotInSnapshotError(CapabilityError, LookupError):
    code = "tool_not_in_snapshot"


class ToolNotGrantedError(CapabilityError):
    code = "tool_not_granted"


def read_action_secret() -> bytes:
    """The action secret from the environment, or :class:`ActionSecretKeyError`."""
    value = os.environ.get(SECRET_ENV_VAR, "")
    if not value.strip():
        raise ActionSecretKeyError(
            f"{SECRET_ENV_VAR} is not set; refusing to derive target keys or encrypt "
            "tool arguments without it"
        )
    return value.encode("utf-8")


@functools.lru_cache(maxsize=16)
def derive_subkey(secret: bytes, label: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=label).derive(secret)


# --------------------------------------------------------------------------- target keys


def _find_tool(snapshot: Mapping[str, Any], tool_name: str) -> Mapping[str, Any]:
    for tool in snapshot.get("tools") or []:
        if isinstance(tool, Mapping) and tool.get("name") == tool_name:
            return tool
    raise ToolNotInSnapshotError(f"tool {tool_name!r} is not in the run's capability snapshot")


def _granted_tool_names(agent: Mapping[str, Any]) -> set[str]:
    names: set[str] = set()
    for grant in agent.get("tools") or []:
        if isinstance(grant, str):
            names.add(grant)
        elif isinstance(grant, Mapping) and isinstance(grant.get("name"), str):
            names.add(grant["name"])
    return names


def _require_grant(snapshot: Mapping[str, Any], tool_name: str, agent_id: str) -> None:
    for agent in snapshot.get("agents") or []:
        if isinstance(agent, Mapping) and agent.get("agent_id") == agent_id:
            if tool_name in _granted_tool_names(agent):
                return
            break
    raise ToolNotGrantedError(f"tool {tool_name!r} is not granted to agent {agent_id!r}")


def _canonical_scalar(value: Any) -> str | None:
    """Text form of a key field, or None when the field cannot pin a target.

    Numbers and strings that print alike map to one key ("7" and 7): a coarser
    lock is safe, a finer guess is not.
    """
    if value is None or isinstance(value, Mapping | list | tuple | set):
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            return None
        if value.is_integer():
            return str(int(value))
        return repr(value)
    if isinstance(value, int | str):
        text = str(value)
        return text if text.strip() else None
    return None


@dataclass(frozen=True)
class Target:
    """Where a write lands, for the lease table.

    ``key`` names the object (``target:v1:…``); ``scope`` names its namespace
    (``scope:v1:…``). A ``namespace_wide`` target could be anything in the
    scope, so it conflicts with every target of that scope, and they with it.
    """

    key: str
    scope: str
    namespace_wide: bool


def derive_target(
    tool_name: str,
    arguments: Mapping[str, Any],
    capability_snapshot: Mapping[str, Any],
    agent_id: str,
) -> Target:
    """The opaque lease key (and scope) of the object a write would touch.

    Only the tool's ``target_key_fields`` count; anything else in ``arguments``
    (a caller-supplied ``target_key`` included) is ignored. If any key field is
    missing, null, empty or not a scalar, the key covers the tool's whole
    namespace. Tools that share a ``target_key_namespace`` share keys, so
    ``ticket_update`` and ``ticket_close`` on one ticket serialize.
    """
    tool = _find_tool(capability_snapshot, tool_name)
    _require_grant(capability_snapshot, tool_name, agent_id)
    return target_of(tool, arguments)


def target_of(tool: Mapping[str, Any], arguments: Mapping[str, Any]) -> Target:
    """:func:`derive_target` for a caller that has the tool's spec (from the
    run's snapshot) and has checked the seat's grant itself."""
    hmac_key = derive_subkey(read_action_secret(), _TARGET_KEY_LABEL)
    namespace = str(tool.get("target_key_namespace") or tool.get("name"))
    fields = sorted({str(f) for f in tool.get("target_key_fields") or []})

    pinned: list[list[str]] = []
    for field in fields:
        text = _canonical_scalar(arguments.get(field)) if isinstance(arguments, Mapping) else None
        if text is None:
            pinned = []
            break
        pinned.append([field, text])

    def digest(material: list[Any]) -> str:
        return hmac.new(hmac_key, _canonical_json(material), hashlib.sha256).hexdigest()

    return Target(
        key=TARGET_KEY_PREFIX + digest(["target", namespace, pinned if pinned else "*"]),
        scope=SCOPE_KEY_PREFIX + digest(["scope", namespace]),
        namespace_wide=not pinned,
    )


def derive_target_key(
    tool_name: str,
    arguments: Mapping[str, Any],
    capability_snapshot: Mapping[str, Any],
    agent_id: str,
) -> str:
    """Just the ``target:v1:…`` key of :func:`derive_target`."""
    return derive_target(tool_name, arguments, capability_snapshot, agent_id).key


def _canonical_json(value: Any) -> bytes:
    # surrogatepass: a model's lone surrogate must not make a write unrecordable
    # (strict UTF-8 raised); text without surrogates encodes as before.
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return text.encode("utf-8", "surrogatepass")


# --------------------------------------------------------------------------- digests

_DIGEST_LABEL = b"roundtable/arguments-digest/v1"


def arguments_digest(action_id: str, tool_name: str, arguments: Mapping[str, Any]) -> str:
    """Binds an approval to the exact full arguments, without revealing them:
    a decision carrying another digest was made about other arguments."""
    key = derive_subkey(read_action_secret(), _DIGEST_LABEL)
    material = _canonical_json(["digest", action_id, tool_name, dict(arguments)])
    return "sha256:" + hmac.new(key, material, hashlib.sha256).hexdigest()


# --------------------------------------------------------------------------- encryption


def _key_id(key: bytes) -> str:
    # Names the key without revealing it, so a ciphertext sealed under a
    # rotated-away secret says so instead of failing as "tampered".
    return hashlib.sha256(b"roundtable/key-id/" + key).hexdigest()[:12]


def encrypt_arguments(arguments: Mapping[str, Any], *, associated_data: bytes = b"") -> str:
    """Seal tool arguments with AES-GCM. ``associated_data`` binds the ciphertext
    to its owner (the store passes the action id), so it cannot be moved."""
    key = derive_subkey(read_action_secret(), _ARGUMENTS_KEY_LABEL)
    nonce = secrets.token_bytes(_NONCE_BYTES)
    sealed = AESGCM(key).encrypt(nonce, _canonical_json(dict(arguments)), associated_data)
    blob = base64.urlsafe_b64encode(nonce + sealed).decode("ascii")
    return f"{_CIPHERTEXT_PREFIX}:{_key_id(key)}:{blob}"


def decrypt_arguments(ciphertext: str, *, associated_data: bytes = b"") -> dict[str, Any]:
    """Open what :func:`encrypt_arguments` sealed; anything altered raises."""
    key = derive_subkey(read_action_secret(), _ARGUMENTS_KEY_LABEL)
    try:
        prefix, version, key_id, blob = ciphertext.split(":", 3)
        raw = base64.urlsafe_b64decode(blob.encode("ascii"))
    except (ValueError, AttributeError) as exc:
        raise ArgumentsDecryptionError("ciphertext is malformed") from exc
    if f"{prefix}:{version}" != _CIPHERTEXT_PREFIX or len(raw) <= _NONCE_BYTES:
        raise ArgumentsDecryptionError("ciphertext is malformed")
    if key_id != _key_id(key):
        raise ArgumentsDecryptionError("ciphertext was sealed under a different secret")
    try:
        plain = AESGCM(key).decrypt(raw[:_NONCE_BYTES], raw[_NONCE_BYTES:], associated_data)
    except InvalidTag as exc:
        raise ArgumentsDecryptionError("ciphertext failed authentication") from exc
    value = json.loads(plain.decode("utf-8", "surrogatepass"))
    if not isinstance(value, dict):
        raise ArgumentsDecryptionError("ciphertext does not hold an arguments object")
    return value


# --------------------------------------------------------------------------- public views


def redact_arguments(
    arguments: Mapping[str, Any] | None, safe_fields: Iterable[str] | None = None
) -> dict[str, Any]:
    """Keys stay visible; only values named in ``safe_fields`` do."""
    safe = set(safe_fields or ())
    return {
        str(name): (value if name in safe else REDACTED)
        for name, value in (arguments or {}).items()
    }


_MIN_REDACTED_LENGTH = 4  # shorter values would blank out ordinary words
_QUOTE_WINDOW = 12  # a message quoting this much of a value, in any form, is withheld
MAX_ERROR_MESSAGE_CHARS = 500
WITHHELD = "[message withheld: it quoted the tool's arguments]"


def _leaves(value: Any) -> Iterable[str]:
    if isinstance(value, Mapping):
        for item in value.values():
            yield from _leaves(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _leaves(item)
    elif value is not None and not isinstance(value, bool):
        yield str(value)


def _secret_leaves(
    arguments: Mapping[str, Any] | None, safe_fields: Iterable[str] | None
) -> set[str]:
    """The argument values to hide: every leaf of a field not marked safe,
    four characters or longer."""
    safe = set(safe_fields or ())
    return {
        leaf
        for name, value in (arguments or {}).items()
        if name not in safe
        for leaf in _leaves(value)
        if len(leaf) >= _MIN_REDACTED_LENGTH
    }


def _spellings(value: str) -> set[str]:
    """How a value may appear in a message: as is, JSON-, repr-, HTML- or
    URL-escaped, hex- or base64-encoded (as in an echoed Basic credential,
    where the value follows ``user:`` at any offset)."""
    raw = value.encode()
    forms = {
        value,
        json.dumps(value)[1:-1],
        json.dumps(value, ensure_ascii=False)[1:-1],
        json.dumps(json.dumps(value)[1:-1])[1:-1],  # JSON inside a JSON string
        repr(value)[1:-1],
        value.encode("unicode_escape").decode("ascii"),
        urllib.parse.quote(value, safe=""),
        urllib.parse.quote_plus(value),
        html.escape(value),
        html.escape(value, quote=False),
        base64.b64encode(raw).decode().rstrip("="),
        base64.urlsafe_b64encode(raw).decode().rstrip("="),
    }
    return forms | _encodings(raw)


_MAX_REPLACED_ENCODING = 256  # a longer encoded value is withheld, not replaced


def _encodings(raw: bytes) -> set[str]:
    """The value hex-encoded, or base64-encoded at any offset."""
    return {raw.hex()} | _base64_cores(raw)


_MIN_BASE64_CORE = 6  # shorter cores would match ordinary base64 by chance


def _base64_cores(raw: bytes) -> set[str]:
    """The base64 characters that spell ``raw`` whatever precedes and follows
    it: it may start at any of the three byte offsets of a group (``user:``
    before a password), and its last character mixes with the next byte."""
    cores = set()
    for shift in range(3):
        for encode in (base64.b64encode, base64.urlsafe_b64encode):
            text = encode(b"\0" * shift + raw).decode().rstrip("=")
            start = (0, 2, 3)[shift]  # characters that mix with the bytes before
            end = len(text) - (1 if (shift + len(raw)) % 3 else 0)
            core = text[start:end]
            if len(core) >= _MIN_BASE64_CORE:
                cores.add(core)
    return cores


_SPACES = re.compile(r"\s+")


def _fold(text: str) -> str:
    """Text as compared for quotes: compatibility-normalised (NFD, full-width),
    case-folded, whitespace runs as one space: a tool that reflows or
    re-normalises what it echoes still quotes it."""
    return _SPACES.sub(" ", unicodedata.normalize("NFKC", text).casefold())


def redact_text(
    text: str, arguments: Mapping[str, Any] | None, safe_fields: Iterable[str] | None = None
) -> str:
    """A tool's error message, safe to store and show. Every argument value
    that is not a safe field (at any depth, four characters or longer) is
    replaced by ``[redacted]``, however it was escaped; a message that still
    quotes a long value in part (truncated, re-encoded) is withheld whole.
    The result is bounded."""
    return text_redactor(arguments, safe_fields)(text)


def text_redactor(
    arguments: Mapping[str, Any] | None,
    safe_fields: Iterable[str] | None = None,
    *,
    limit: int | None = MAX_ERROR_MESSAGE_CHARS,
    withheld: str = WITHHELD,
) -> Callable[[str], str]:
    """:func:`redact_text` for many texts and the same arguments: the values'
    spellings and quote windows (the costly part, growing with the values'
    length) are worked out once, not once per text. ``limit`` bounds each
    text (None: no bound); ``withheld`` replaces a text that quotes a value
    in part."""
    values = _secret_leaves(arguments, safe_fields)
    spelled = {form for v in values for form in _spellings(v)}
    # A long value's encodings are not replaced (compiling them costs seconds
    # for a 64 KB value): a text quoting one is withheld by its windows.
    encoded = {form for v in values for form in _encodings(v.encode())}
    replaced = sorted(
        (f for f in spelled if f not in encoded or len(f) <= _MAX_REPLACED_ENCODING),
        key=len,
        reverse=True,
    )
    # Longest first, so a value containing another goes whole; one pattern
    # for all, so each text is scanned once, not once per spelling.
    pattern = re.compile("|".join(map(re.escape, replaced)), re.IGNORECASE) if replaced else None
    folded_forms = {_fold(form) for form in spelled}
    windows = {
        form[i : i + _QUOTE_WINDOW]
        for form in folded_forms
        if len(form) >= _QUOTE_WINDOW
        for i in range(len(form) - _QUOTE_WINDOW + 1)
    }

    def redact(text: str) -> str:
        if pattern is not None:
            text = pattern.sub(REDACTED, text)
        folded = _fold(text)
        if windows and any(
            folded[i : i + _QUOTE_WINDOW] in windows for i in range(len(folded) - _QUOTE_WINDOW + 1)
        ):
            return withheld
        if limit is not None and len(text) > limit:
            text = text[:limit] + "…"
        return text

    return redact


RESULT_VALUE_WITHHELD = "[value withheld: it quoted the tool's arguments]"


def redact_result(
    result: Any, arguments: Mapping[str, Any] | None, safe_fields: Iterable[str] | None = None
) -> Any:
    """A tool's result, safe to store and show: a tool may echo what it was
    given (a token, a password), and the result is stored in plain text,
    returned by the API and handed to the agents. Every text in it, keys
    included, goes through :func:`text_redactor` (unbounded: results have
    their own bound); a number or other scalar whose text or numeric value is
    a redacted argument value becomes ``[redacted]``, and so does a value of
    any length under a key named after a secret argument that holds it (a
    three-digit code echoed as ``{"cvv": "123"}``). Keys that redact alike
    are all kept, numbered."""
    safe = set(safe_fields or ())
    secrets = _secret_leaves(arguments, safe_fields)
    by_name = {
        str(name): {leaf for leaf in _leaves(value) if leaf}
        for name, value in (arguments or {}).items()
        if name not in safe
    }
    if not secrets and not any(by_name.values()):
        return result
    numbers = {n for n in map(_number, secrets) if n is not None}
    redact = text_redactor(arguments, safe_fields, limit=None, withheld=RESULT_VALUE_WITHHELD)

    def scalar(value: Any, name: str | None) -> Any:
        if value is None or isinstance(value, bool):
            return value
        text = str(value)
        if text in secrets or (name is not None and text in by_name.get(name, ())):
            return REDACTED
        if isinstance(value, int | float) and _number(value) in numbers:
            return REDACTED
        return redact(value) if isinstance(value, str) else value

    def walk(value: Any, name: str | None = None) -> Any:
        if isinstance(value, Mapping):
            shown: dict[str, Any] = {}
            taken: dict[str, int] = {}  # the last number given to a label
            for key, item in value.items():
                label = redact(str(key))
                unique, n = label, taken.get(label, 1)
                if n > 1:
                    unique = f"{label} ({n})"
                while unique in shown:  # two keys redacted alike: keep both
                    n += 1
                    unique = f"{label} ({n})"
                taken[label] = n
                shown[unique] = walk(item, str(key))
            return shown
        if isinstance(value, list | tuple):
            return [walk(item, name) for item in value]
        return scalar(value, name)

    return walk(result)


def _number(value: Any) -> float | None:
    """The numeric value of a number or of a text that spells one (``1e3``,
    ``1000``, ``1000.0`` alike), or None."""
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return number if math.isfinite(number) else None


def argument_changes(
    before: Mapping[str, Any], after: Mapping[str, Any], safe_fields: Iterable[str] | None
) -> list[dict[str, Any]]:
    """What an edit changed, field by field, with values redacted as the
    public view redacts them (the names of changed fields are always shown)."""
    safe = set(safe_fields or ())
    shown = lambda name, value: value if name in safe else REDACTED  # noqa: E731
    return [
        {
            "field": name,
            "before": shown(name, before.get(name)),
            "after": shown(name, after.get(name)),
        }
        for name in sorted(set(before) | set(after))
        if before.get(name) != after.get(name) or (name in before) != (name in after)
    ]


PUBLIC_ACTION_FIELDS: tuple[str, ...] = (
    "id",
    "session_id",
    "run_id",
    "agent_id",
    "tool_name",
    "logical_action_id",
    "turn_index",
    "risk_level",
    "status",
    "arguments",
    "result",
    "external_object_id",
    "approval_id",
    "attempt_count",
    "started_at",
    "finished_at",
    "created_at",
    "updated_at",
)


def _public_value(value: Any) -> Any:
    return value.isoformat() if isinstance(value, datetime) else value


def action_to_public_dict(row: Mapping[str, Any]) -> dict[str, Any]:
    """The one view of an action that leaves the process: an explicit allowlist.

    ``arguments`` is redacted again here (idempotent for stored rows), so a row
    that somehow carries raw arguments still cannot leak them.
    """
    public = {name: _public_value(row.get(name)) for name in PUBLIC_ACTION_FIELDS}
    public["arguments"] = redact_arguments(row.get("arguments"), row.get("safe_argument_fields"))
    return public


PUBLIC_APPROVAL_FIELDS: tuple[str, ...] = (
    "id",
    "run_id",
    "action_id",
    "status",
    "expires_at",
    "decided_by",
    "decision_reason",
    "decided_at",
    "created_at",
    "updated_at",
)


def approval_to_public_dict(
    row: Mapping[str, Any], action: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """An approval as operators see it; with its action, also what they approve
    (tool, seat and the redacted arguments)."""
    public = {name: _public_value(row.get(name)) for name in PUBLIC_APPROVAL_FIELDS}
    if action is not None:
        shown = action_to_public_dict(action)
        public.update(
            tool_name=shown["tool_name"], agent_id=shown["agent_id"], arguments=shown["arguments"]
        )
    return public
