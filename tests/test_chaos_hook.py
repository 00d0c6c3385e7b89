"""The chaos harness's database fault hook is inert in production: it fires
only with ROUNDTABLE_CHAOS=1, and then fails the store's transaction whole."""

from __future__ import annotations

import pytest

from roundtable import chaos_hook
from roundtable.chaos_hook import InjectedDatabaseFault
from tests.helpers import new_action, new_run, target_for

ARMED = "record_result:1.0,renew:1.0"


def test_rates_parse_known_points_only() -> None:
    assert chaos_hook.rates("record_result:0.2, renew:2, bogus:1, renew") == {
        "record_result": 0.2,
        "renew": 1.0,
    }


def test_the_hook_is_inert_without_the_chaos_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ROUNDTABLE_CHAOS", raising=False)
    monkeypatch.setenv("ROUNDTABLE_CHAOS_DB_FAULTS", ARMED)
    for point in chaos_hook.POINTS:
        chaos_hook.maybe_fail(point)  # armed at 100 %, yet nothing happens
    monkeypatch.setenv("ROUNDTABLE_CHAOS", "true")  # only "1" switches it on
    chaos_hook.maybe_fail("renew")


def test_a_file_arms_and_disarms_it(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    armed = tmp_path / "faults"
    monkeypatch.setenv("ROUNDTABLE_CHAOS", "1")
    monkeypatch.setenv("ROUNDTABLE_CHAOS_DB_FAULTS_FILE", str(armed))
    chaos_hook.maybe_fail("renew")  # no file yet: disarmed
    armed.write_text(ARMED)
    with pytest.raises(InjectedDatabaseFault):
        chaos_hook.maybe_fail("renew")
    armed.write_text("")
    chaos_hook.maybe_fail("renew")


async def test_inert_store_records_and_renews(store, monkeypatch) -> None:
    monkeypatch.delenv("ROUNDTABLE_CHAOS", raising=False)
    monkeypatch.setenv("ROUNDTABLE_CHAOS_DB_FAULTS", ARMED)
    run = await new_run(store)
    action = await new_action(store, run, key="a", target_key=target_for())
    assert await store.claim_action_for_execution(action["id"], lease_seconds=30) == "claimed"
    token = (await store.get_action(action["id"]))["fencing_token"]
    assert await store.renew_action_lease(action["id"], token, 30)
    assert await store.record_action_terminal_result(action["id"], "succeeded", {"ok": True})


async def test_armed_store_fails_before_commit(store, monkeypatch) -> None:
    run = await new_run(store)
    action = await new_action(store, run, key="a", target_key=target_for())
    assert await store.claim_action_for_execution(action["id"], lease_seconds=30) == "claimed"
    token = (await store.get_action(action["id"]))["fencing_token"]
    monkeypatch.setenv("ROUNDTABLE_CHAOS", "1")
    monkeypatch.setenv("ROUNDTABLE_CHAOS_DB_FAULTS", ARMED)
    with pytest.raises(InjectedDatabaseFault):
        await store.record_action_terminal_result(action["id"], "succeeded", {"ok": True})
    with pytest.raises(InjectedDatabaseFault):
        await store.hold_action_lease(action["id"], token, 30)
    # Rolled back: the action still executes under its lease.
    assert (await store.get_action(action["id"]))["status"] == "executing"
    monkeypatch.setenv("ROUNDTABLE_CHAOS_DB_FAULTS", "")
    assert await store.record_action_terminal_result(action["id"], "succeeded", {"ok": True})
