"""API tokens are stored hashed, shown once, and revocable; digests bind decisions."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import text

from roundtable.store import ConflictError, InvalidInputError, NotFoundError
from tests.helpers import new_action, new_run, target_for


async def test_tokens_are_hashed_shown_once_and_revocable(store) -> None:
    token, record = await store.create_token(user_id="alice", role="operator", label="laptop")
    assert token.startswith("rt_") and len(token) > 40
    assert "token_hash" not in record
    assert (await store.authenticate_token(token))["user_id"] == "alice"
    async with store.session_factory() as session:
        stored = (await session.execute(text("SELECT * FROM api_tokens"))).all()
    assert token not in repr(stored)
    assert [t["label"] for t in await store.list_tokens()] == ["laptop"]

    assert await store.authenticate_token(token + "x") is None
    assert await store.authenticate_token("not-a-token") is None
    await store.revoke_token(record["id"])
    assert await store.authenticate_token(token) is None
    with pytest.raises(ConflictError):
        await store.revoke_token(record["id"])
    with pytest.raises(NotFoundError):
        await store.revoke_token("missing")
    with pytest.raises(InvalidInputError):
        await store.create_token(user_id="bob", role="root")


async def test_a_decision_is_bound_to_the_arguments_digest(store) -> None:
    run = await new_run(store)
    action = await new_action(
        store,
        run,
        key="d",
        target_key=target_for(),
        status="waiting_approval",
        arguments={"tenant_id": "t", "amount": 100},
        approval_expires_at=datetime.now(UTC) + timedelta(minutes=5),
    )
    digest = action["arguments_digest"]
    # A hash and nothing else: no argument value can ride along. (Looking
    # for "100" in it failed whenever the hex happened to hold those digits.)
    assert re.fullmatch(r"sha256:[0-9a-f]{64}", digest)
    other = await new_action(
        store,
        run,
        key="e",
        target_key=target_for("e"),
        status="waiting_approval",
        arguments={"tenant_id": "t", "amount": 999},
        approval_expires_at=datetime.now(UTC) + timedelta(minutes=5),
    )
    assert other["arguments_digest"] != digest
    with pytest.raises(ConflictError, match="arguments_digest"):
        await store.decide_approval(
            action["approval_id"], "approved", "op", None, other["arguments_digest"]
        )
    assert (await store.get_approval(action["approval_id"]))["status"] == "pending"
    decided = await store.decide_approval(action["approval_id"], "approved", "op", None, digest)
    assert decided["status"] == "approved"
