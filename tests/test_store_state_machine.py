"""Hypothesis drives the store with random operations (create, decide,
expire, extend, claim, renew, record, recover with clock jumps, reconcile,
and pairs of them at once) on SQLite and PostgreSQL, and after every step
holds it to a small reference model of the state machines
(docs/architecture.md, section 4)."""

from __future__ import annotations

import asyncio
import os
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    invariant,
    rule,
    run_state_machine_as_test,
)

from roundtable.store import ConflictError, InvalidInputError, NotFoundError, open_store
from tests.helpers import new_action, new_run, target_fields

# Every edge an action may take; anything else is a bug.
ACTION_EDGES = {
    "waiting_approval": {"approved", "rejected"},
    "approved": {"executing", "rejected"},
    "executing": {"succeeded", "failed", "unknown"},
    "unknown": {"succeeded", "failed"},
    "rejected": set(),
    "succeeded": set(),
    "failed": set(),
}
APPROVAL_EDGES = {
    "pending": {"approved", "rejected", "expired", "withdrawn"},
    "approved": set(),
    "rejected": set(),
    "expired": set(),
    "withdrawn": set(),
}
TARGETS = ("t-1", "t-2")  # few, so writes contend


def reachable(edges: dict[str, set[str]], start: str) -> set[str]:
    """Every state some path of edges leads to from ``start`` (one rule may
    take several steps)."""
    seen, todo = {start}, [start]
    while todo:
        for nxt in edges[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


REFUSALS = (ConflictError, InvalidInputError, NotFoundError)


def machine_for(database_url: str) -> type[RuleBasedStateMachine]:
    class StoreMachine(RuleBasedStateMachine):
        actions = Bundle("actions")

        def __init__(self) -> None:
            super().__init__()
            self.loop = asyncio.new_event_loop()
            self.opened = open_store(database_url)
            self.store = self.loop.run_until_complete(self.opened.__aenter__())
            self.run = self.do(new_run(self.store))
            self.seen: dict[str, str] = {}  # action id → status last seen
            self.approvals: dict[str, str] = {}  # approval id → status last seen
            self.tokens: list[int] = []  # fencing tokens, in claim order
            self.clock = datetime.now(UTC)
            self.serial = 0

        def do(self, coroutine: Any) -> Any:
            return self.loop.run_until_complete(coroutine)

        def quietly(self, coroutine: Any) -> Any:
            async def attempt() -> Any:
                try:
                    return await coroutine
                except REFUSALS as refused:
                    return refused

            return self.do(attempt())

        def teardown(self) -> None:
            self.do(self.opened.__aexit__(None, None, None))
            self.loop.close()

        # ------------------------------------------------------------- rules

        @rule(target=actions, where=st.sampled_from(TARGETS), needs_person=st.booleans())
        def create(self, where: str, needs_person: bool) -> str:
            self.serial += 1
            fields = target_fields(where)
            extra: dict[str, Any] = {}
            if needs_person:
                extra["approval_expires_at"] = self.clock + timedelta(hours=1)
            action = self.do(
                new_action(
                    self.store,
                    self.run,
                    key=f"{self.run['id']}-{self.serial}",
                    status="waiting_approval" if needs_person else "approved",
                    **fields,
                    **extra,
                )
            )
            return action["id"]

        @rule(action=actions, decision=st.sampled_from(["approved", "rejected"]))
        def decide(self, action: str, decision: str) -> None:
            approval = self.do(self.store.get_action(action))["approval_id"]
            if approval:
                self.quietly(self.store.decide_approval(approval, decision, "ops"))

        @rule(action=actions)
        def expire(self, action: str) -> None:
            approval = self.do(self.store.get_action(action))["approval_id"]
            if approval:
                self.quietly(self.store.expire_approval(approval))

        @rule(action=actions)
        def extend(self, action: str) -> None:
            approval = self.do(self.store.get_action(action))["approval_id"]
            if approval:
                self.quietly(self.store.extend_approval(approval, 60, "ops", 3600))

        @rule(action=actions)
        def claim(self, action: str) -> None:
            outcome = self.quietly(self.store.claim_action_for_execution(action, 30))
            if outcome == "claimed":
                self.tokens.append(self.do(self.store.get_action(action))["fencing_token"])

        @rule(action=actions)
        def renew(self, action: str) -> None:
            token = self.do(self.store.get_action(action))["fencing_token"]
            if token is not None:
                self.quietly(self.store.renew_action_lease(action, token, 30))

        @rule(
            action=actions,
            status=st.sampled_from(["succeeded", "failed", "unknown"]),
            attempt_over=st.booleans(),
        )
        def record(self, action: str, status: str, attempt_over: bool) -> None:
            # attempt_over: the attempt itself says it has ended (an in-process
            # tool), so an unknown outcome may be reconciled without waiting.
            token = self.do(self.store.get_action(action))["fencing_token"]
            if token is not None:
                self.quietly(
                    self.store.record_action_terminal_result(
                        action,
                        status,
                        {"by": "test"},
                        fencing_token=token,
                        attempt_over=attempt_over,
                    )
                )

        @rule(
            action=actions,
            status=st.sampled_from(["succeeded", "failed", "unknown"]),
            attempt_over=st.booleans(),
        )
        def approve_claim_and_record(self, action: str, status: str, attempt_over: bool) -> None:
            """A whole attempt in one step, so runs reach the deep states
            (unknown, reconciled) often, not only by chance."""
            self.decide(action, "approved")
            self.claim(action)
            self.record(action, status, attempt_over)

        @rule(jump=st.integers(min_value=0, max_value=120))
        def recover(self, jump: int) -> None:
            self.clock += timedelta(seconds=jump)  # the sweep's clock may run ahead
            self.quietly(self.store.recover_expired_action_leases(now=self.clock))

        @rule(action=actions, outcome=st.sampled_from(["succeeded", "failed"]))
        def reconcile(self, action: str, outcome: str) -> None:
            self.quietly(self.store.reconcile_action(action, outcome, "ops", "checked"))

        @rule(one=actions, other=actions)
        def claim_both_at_once(self, one: str, other: str) -> None:
            async def both() -> list[Any]:
                return await asyncio.gather(
                    self.store.claim_action_for_execution(one, 30),
                    self.store.claim_action_for_execution(other, 30),
                    return_exceptions=True,
                )

            for action, outcome in zip((one, other), self.do(both()), strict=True):
                if outcome == "claimed" and one != other:
                    self.tokens.append(self.do(self.store.get_action(action))["fencing_token"])

        # ------------------------------------------------------------- invariants

        @invariant()
        def states_move_only_along_their_edges(self) -> None:
            actions = self.do(self.store.list_actions(self.run["id"]))
            for action in actions:
                before = self.seen.get(action["id"], action["status"])
                now = action["status"]
                assert now in reachable(ACTION_EDGES, before), (before, now, action)
                self.seen[action["id"]] = now
            for approval in self.do(self.store.list_approvals(run_id=self.run["id"])):
                before = self.approvals.get(approval["id"], "pending")
                now = approval["status"]
                assert now in reachable(APPROVAL_EDGES, before), (before, now)
                self.approvals[approval["id"]] = now

        @invariant()
        def one_writer_per_target(self) -> None:
            actions = self.do(self.store.list_actions(self.run["id"]))
            holding: dict[str, list[str]] = {}
            for action in actions:
                if action["status"] in ("executing", "unknown"):
                    holding.setdefault(action["target_key"], []).append(action["id"])
            assert all(len(ids) == 1 for ids in holding.values()), holding

        @invariant()
        def tokens_grow_per_scope(self) -> None:
            # One scope here: every claim's token is larger than every earlier one.
            assert self.tokens == sorted(self.tokens), self.tokens
            assert len(set(self.tokens)) == len(self.tokens), self.tokens

        @invariant()
        def approvals_and_actions_agree(self) -> None:
            approvals = {
                a["id"]: a["status"]
                for a in self.do(self.store.list_approvals(run_id=self.run["id"]))
            }
            for action in self.do(self.store.list_actions(self.run["id"])):
                if not action["approval_id"]:
                    continue
                approval = approvals[action["approval_id"]]
                if approval == "pending":
                    assert action["status"] == "waiting_approval", action
                if approval in ("rejected", "expired", "withdrawn"):
                    assert action["status"] == "rejected", (approval, action)

        @invariant()
        def the_audit_chain_holds(self) -> None:
            assert self.do(self.store.verify_audit_chain(self.run["id"]))

    return StoreMachine


# `make test` walks 25 sequences (the first 25 of the same derandomized
# ones); `make stress` 100.
EXAMPLES = int(os.environ.get("STATE_MACHINE_EXAMPLES", "25"))


@pytest.mark.timeout(600)
def test_the_store_follows_its_state_machines(database_url: str) -> None:
    run_state_machine_as_test(
        machine_for(database_url),
        settings=settings(
            max_examples=EXAMPLES,
            stateful_step_count=40,
            deadline=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
        ),
    )
