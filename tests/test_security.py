"""Target keys, argument encryption and the public action view."""

from __future__ import annotations

import pytest

from roundtable.security import (
    REDACTED,
    ActionSecretKeyError,
    ArgumentsDecryptionError,
    CapabilityError,
    ToolNotGrantedError,
    ToolNotInSnapshotError,
    action_to_public_dict,
    decrypt_arguments,
    derive_target,
    derive_target_key,
    encrypt_arguments,
    target_of,
)
from tests.helpers import WRITE_TOOL, snapshot

SECRET_ENV = "ROUNDTABLE_ACTION_SECRET_KEY"


def key(args: dict, agent: str = "seat-1", snap: dict | None = None) -> str:
    return derive_target_key(WRITE_TOOL, args, snap or snapshot(), agent)


def test_only_declared_fields_count_and_forged_keys_are_ignored() -> None:
    honest = {"tenant_id": "tenant-a", "object_id": "task-7", "note": "x"}
    forged = {"tenant_id": "tenant-a", "object_id": "task-7", "target_key": "forged", "note": "y"}
    assert key(honest) == key(forged)
    assert key(honest) != key({"tenant_id": "tenant-a", "object_id": "task-8"})


def test_key_is_opaque_and_versioned() -> None:
    value = key({"tenant_id": "tenant-a", "object_id": "task-7", "target_key": "browser-forged"})
    assert value.startswith("target:v1:")
    assert len(value) == len("target:v1:") + 64
    for fragment in ("tenant-a", "task-7", "browser-forged", "lease-test", WRITE_TOOL):
        assert fragment not in value


@pytest.mark.parametrize(
    "object_id", [None, "", "   ", {"id": "task-7"}, ["task-7"], float("nan")], ids=repr
)
def test_unusable_key_fields_give_the_namespace_wide_key(object_id: object) -> None:
    namespace_wide = key({"tenant_id": "tenant-a"})
    assert key({"tenant_id": "tenant-a", "object_id": object_id}) == namespace_wide
    # Namespace-wide means the whole namespace, whichever tenant was named.
    assert key({"tenant_id": "tenant-b", "object_id": object_id}) == namespace_wide
    assert key({"tenant_id": "tenant-a", "object_id": "task-7"}) != namespace_wide


def test_numbers_and_their_text_pin_the_same_target() -> None:
    assert key({"tenant_id": "t", "object_id": 7}) == key({"tenant_id": "t", "object_id": "7"})
    assert key({"tenant_id": "t", "object_id": 7.0}) == key({"tenant_id": "t", "object_id": 7})


def test_tools_sharing_a_namespace_share_keys() -> None:
    snap = snapshot()
    other = dict(snap["tools"][0], name="controlled_close")
    snap["tools"].append(other)
    snap["agents"][0]["tools"].append(other)
    args = {"tenant_id": "tenant-a", "object_id": "task-7"}
    assert derive_target_key("controlled_close", args, snap, "seat-1") == key(args)


def test_missing_secret_fails_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    args = {"tenant_id": "tenant-a", "object_id": "task-7"}
    for missing in (None, "", "   "):
        if missing is None:
            monkeypatch.delenv(SECRET_ENV, raising=False)
        else:
            monkeypatch.setenv(SECRET_ENV, missing)
        with pytest.raises(ActionSecretKeyError):
            key(args)
        with pytest.raises(ActionSecretKeyError):
            encrypt_arguments(args)


def test_another_secret_gives_another_key(monkeypatch: pytest.MonkeyPatch) -> None:
    args = {"tenant_id": "tenant-a", "object_id": "task-7"}
    first = key(args)
    monkeypatch.setenv(SECRET_ENV, "a-completely-different-domain-secret")
    assert key(args) != first


def test_tool_must_be_in_snapshot_and_granted() -> None:
    args = {"tenant_id": "tenant-a", "object_id": "task-7"}
    with pytest.raises(ToolNotInSnapshotError):
        derive_target_key("not_a_tool", args, snapshot(), "seat-1")
    with pytest.raises(ToolNotGrantedError):
        derive_target_key(WRITE_TOOL, args, snapshot("seat-1"), "seat-9")
    ungranted = snapshot()
    ungranted["agents"][0]["tools"] = []
    with pytest.raises(CapabilityError):
        derive_target_key(WRITE_TOOL, args, ungranted, "seat-1")
    # Grants may also be written as plain tool names.
    by_name = snapshot()
    by_name["agents"][0]["tools"] = [WRITE_TOOL]
    assert derive_target_key(WRITE_TOOL, args, by_name, "seat-1") == key(args)


def test_encryption_round_trips_and_hides_plaintext() -> None:
    args = {"tenant_id": "t", "api_token": "sk-canary-123", "nested": {"n": [1, 2]}}
    sealed = encrypt_arguments(args)
    assert "sk-canary-123" not in sealed
    assert decrypt_arguments(sealed) == args
    assert encrypt_arguments(args) != sealed  # fresh nonce every time


def test_tampered_ciphertext_is_refused() -> None:
    sealed = encrypt_arguments({"amount": 100})
    head, blob = sealed.rsplit(":", 1)
    middle = len(blob) // 2
    flipped = blob[:middle] + ("A" if blob[middle] != "A" else "B") + blob[middle + 1 :]
    for broken in (f"{head}:{flipped}", sealed[:-4], "enc:v1:nonsense", "", "plain text"):
        with pytest.raises(ArgumentsDecryptionError):
            decrypt_arguments(broken)


def test_ciphertext_is_bound_to_its_owner_and_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    sealed = encrypt_arguments({"amount": 100}, associated_data=b"action-1")
    assert decrypt_arguments(sealed, associated_data=b"action-1") == {"amount": 100}
    with pytest.raises(ArgumentsDecryptionError):
        decrypt_arguments(sealed, associated_data=b"action-2")
    monkeypatch.setenv(SECRET_ENV, "a-completely-different-domain-secret")
    with pytest.raises(ArgumentsDecryptionError, match="different secret"):
        decrypt_arguments(sealed, associated_data=b"action-1")


PUBLIC_FIELDS = {
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
}


def test_public_view_is_an_allowlist() -> None:
    internal = {name: f"value-{name}" for name in PUBLIC_FIELDS}
    internal.update(
        arguments={"tenant_id": "t", "password": "hunter2"},
        safe_argument_fields=["tenant_id"],
        target_key="private-target",
        idempotency_key="private-idempotency",
        fencing_token=9,
        internal_canary="must-not-leak",
    )
    public = action_to_public_dict(internal)
    assert set(public) == PUBLIC_FIELDS
    text = repr(public)
    for secret in ("private-target", "private-idempotency", "must-not-leak", "hunter2"):
        assert secret not in text
    assert public["arguments"] == {"tenant_id": "t", "password": REDACTED}


def test_public_view_redacts_everything_without_a_safe_list() -> None:
    public = action_to_public_dict({"id": "a", "arguments": {"x": 1, "y": "two"}})
    assert public["arguments"] == {"x": REDACTED, "y": REDACTED}
    assert public["status"] is None


def test_the_target_from_a_spec_is_the_target_derive_target_gives() -> None:
    """The write activities take the tool's spec from the snapshot and check the
    grant once, themselves; the key must be the one derive_target derives."""
    spec = next(t for t in snapshot()["tools"] if t["name"] == WRITE_TOOL)
    for arguments in ({"ticket_id": "T-1", "status": "open"}, {}, {"ticket_id": None}):
        assert target_of(spec, arguments) == derive_target(
            WRITE_TOOL, arguments, snapshot(), "seat-1"
        )


def test_a_result_loses_every_argument_it_echoes_and_nothing_else() -> None:
    from roundtable.security import RESULT_VALUE_WITHHELD, redact_result

    arguments = {"ticket_id": "T-1", "token": "tok-9f8e7d6c5b4a", "pin": 482913, "tags": ["vip"]}
    long_text = "ok " * 400  # results are bounded elsewhere: not cut here
    result = {
        "ticket_id": "T-1",
        "headers": {"Authorization": "Bearer tok-9f8e7d6c5b4a", "tok-9f8e7d6c5b4a": True},
        "codes": [482913, 482914, "482913"],
        "partial": "prefix 9f8e7d6c5b4a suffix",
        "long": long_text,
        "flag": True,
        "nothing": None,
    }
    shown = redact_result(result, arguments, ["ticket_id"])
    assert shown == {
        "ticket_id": "T-1",
        "headers": {"Authorization": "Bearer [redacted]", "[redacted]": True},
        "codes": [REDACTED, 482914, REDACTED],
        "partial": RESULT_VALUE_WITHHELD,
        "long": long_text,
        "flag": True,
        "nothing": None,
    }
    # With nothing to hide, the result is the very object the tool gave.
    assert redact_result(result, {"ticket_id": "T-1"}, ["ticket_id"]) is result
