"""An approval is extended a bounded number of times, up to a bounded total:
beyond either the store refuses (ConflictError), so the API answers 409 and
the CLI and typed client, which go through the same store, refuse too."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from roundtable.config import Settings
from roundtable.store import ConflictError, Store
from tests.api_server import serve_api
from tests.helpers import new_action, new_run, target_for
from tests.test_api import pending_approval, start
from tests.workflow_harness import harness

WEEK = 7 * 24 * 3600


async def _pending(store: Store, hours: float = 1) -> dict:
    run = await new_run(store)
    action = await new_action(
        store,
        run,
        key=f"k-{run['id']}",
        target_key=target_for(run["id"]),
        status="waiting_approval",
        approval_expires_at=datetime.now(UTC) + timedelta(hours=hours),
    )
    return await store.get_approval(action["approval_id"])


async def test_a_fourth_extension_is_refused_by_default(store: Store) -> None:
    approval = await _pending(store)
    assert Settings().max_approval_extensions == 3
    for _ in range(3):
        await store.extend_approval(approval["id"], 60, "alice", WEEK)
    with pytest.raises(ConflictError, match="at most 3 extensions"):
        await store.extend_approval(approval["id"], 60, "alice", WEEK)
    refused = await store.get_approval(approval["id"])
    assert refused["expires_at"] == approval["expires_at"] + timedelta(seconds=180)
    events = [e["event_type"] for e in await store.list_events(approval["run_id"])]
    assert events.count("approval.extended") == 3


async def test_extensions_are_counted_per_approval_and_the_limit_is_configurable(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ROUNDTABLE_MAX_APPROVAL_EXTENSIONS", "1")
    first, second = await _pending(store), await _pending(store)
    await store.extend_approval(first["id"], 60, "alice", WEEK)
    await store.extend_approval(second["id"], 60, "alice", WEEK)
    with pytest.raises(ConflictError):
        await store.extend_approval(first["id"], 60, "alice", WEEK)
    # An explicit limit (as the API passes its settings) wins over the environment.
    await store.extend_approval(first["id"], 60, "alice", WEEK, max_extensions=2)


async def test_an_extension_past_the_total_is_refused(store: Store) -> None:
    approval = await _pending(store, hours=1)
    with pytest.raises(ConflictError, match="cannot stay open past"):
        await store.extend_approval(approval["id"], 3600, "alice", WEEK, max_total_seconds=5400)
    await store.extend_approval(approval["id"], 1200, "alice", WEEK, max_total_seconds=5400)
    # By default at most a week after creation, whatever the single extension's bound.
    with pytest.raises(ConflictError):
        await store.extend_approval(approval["id"], WEEK, "alice", WEEK)
    assert (await store.get_approval(approval["id"]))["status"] == "pending"


async def test_api_refuses_extensions_beyond_the_limits_with_409(tmp_path) -> None:
    async with harness(tmp_path) as h, serve_api(h) as api:
        started = await start(api, approval_timeout_seconds=600)
        approval = await pending_approval(api, started["run_id"])
        path = f"/v1/approvals/{approval['id']}/extend"
        past_total = await api.http.post(path, json={"seconds": WEEK}, headers=api.auth("alice"))
        assert past_total.status_code == 409, past_total.text
        assert past_total.headers["content-type"] == "application/problem+json"
        assert "cannot stay open past" in past_total.json()["detail"]
        for _ in range(3):
            ok = await api.http.post(path, json={"seconds": 60}, headers=api.auth("alice"))
            assert ok.status_code == 200, ok.text
        fourth = await api.http.post(path, json={"seconds": 60}, headers=api.auth("alice"))
        assert fourth.status_code == 409, fourth.text
        assert "at most 3 extensions" in fourth.json()["detail"]
        assert (await pending_approval(api, started["run_id"]))["expires_at"] == ok.json()[
            "expires_at"
        ]
