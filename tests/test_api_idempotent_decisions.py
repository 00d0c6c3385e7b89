"""Decisions and extensions over HTTP under an ``Idempotency-Key``.

An operator's client whose answer was lost (a timeout, a dropped connection)
sends the request again. Under the same key and body it is the same request:
answered as the first was, applied once. Anything else (another key, no
key, another body, another caller with the same key) is another request,
met as one: on a decided approval, a conflict.

Real HTTP, a real worker, the time-skipping Temporal server.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

import roundtable.operations as operations
from roundtable.permissions import MAX_ATTESTATION_AGE, attest
from tests.api_server import Api, serve_api
from tests.test_api import finished, pending_approval, start
from tests.workflow_harness import harness

KEYED = "Idempotency-Key"


async def _events(api: Api, run_id: str, event_type: str) -> list[dict[str, Any]]:
    listed = await api.http.get(f"/v1/runs/{run_id}/events", headers=api.auth("alice"))
    return [e for e in listed.json()["items"] if e["event_type"] == event_type]


async def _approval_to_decide(api: Api) -> tuple[dict, str, dict]:
    """A run of alice's waiting for one approval: the run, the approval's
    decision path and the body that approves it."""
    started = await start(api)
    approval = await pending_approval(api, started["run_id"])
    path = f"/v1/approvals/{approval['id']}/decision"
    body = {"decision": "approved", "arguments_digest": approval["arguments_digest"]}
    return started, path, body


async def test_a_decision_sent_again_under_its_key_is_answered_as_the_first(tmp_path) -> None:
    async with harness(tmp_path) as h, serve_api(h) as api:
        started, path, body = await _approval_to_decide(api)
        keyed = {**api.auth("alice"), KEYED: "approve-T-1"}

        first = await api.http.post(path, json=body, headers=keyed)
        assert first.status_code == 200, first.text
        assert "Idempotent-Replayed" not in first.headers
        again = await api.http.post(path, json=body, headers=keyed)
        assert again.status_code == 200, again.text
        assert again.json() == first.json()
        assert again.headers["Idempotent-Replayed"] == "true"

        # Other requests on the decided approval: the conflict they always were.
        rejected = {**body, "decision": "rejected"}
        others = [
            (body, {**api.auth("alice"), KEYED: "approve-T-1-again"}),  # another key
            (body, api.auth("alice")),  # no key
            (rejected, keyed),  # the same key, another request
            (body, {**api.auth("ops"), KEYED: "approve-T-1"}),  # another caller's key
        ]
        for other_body, headers in others:
            answer = await api.http.post(path, json=other_body, headers=headers)
            assert answer.status_code == 409, (headers.get(KEYED), other_body, answer.text)
            assert "Idempotent-Replayed" not in answer.headers

        assert (await finished(api, started["run_id"]))["status"] == "completed"
        decided = await _events(api, started["run_id"], "approval.approved")
        assert len(decided) == 1 and decided[0]["payload"]["decided_by"] == "alice"


async def test_an_extension_sent_again_under_its_key_moves_the_deadline_once(tmp_path) -> None:
    async with harness(tmp_path) as h, serve_api(h) as api:
        started = await start(api, approval_timeout_seconds=600)
        approval = await pending_approval(api, started["run_id"])
        path = f"/v1/approvals/{approval['id']}/extend"
        keyed = {**api.auth("alice"), KEYED: "more-time"}

        first = await api.http.post(path, json={"seconds": 3600}, headers=keyed)
        assert first.status_code == 200, first.text
        again = await api.http.post(path, json={"seconds": 3600}, headers=keyed)
        assert again.status_code == 200, again.text
        assert again.json() == first.json()
        assert again.headers["Idempotent-Replayed"] == "true"  # from the record, still pending
        listed = await pending_approval(api, started["run_id"])
        assert listed["expires_at"] == first.json()["expires_at"]
        assert len(await _events(api, started["run_id"], "approval.extended")) == 1

        # Another body under the same key is another request: a second extension.
        other = await api.http.post(path, json={"seconds": 60}, headers=keyed)
        assert other.status_code == 200, other.text
        assert other.json()["expires_at"] > first.json()["expires_at"]
        assert len(await _events(api, started["run_id"], "approval.extended")) == 2

        # Once the approval is decided, the first extension sent again is still
        # answered as recorded (from the audit log, not the run).
        body = {"decision": "approved", "arguments_digest": approval["arguments_digest"]}
        decided = await api.http.post(
            f"/v1/approvals/{approval['id']}/decision", json=body, headers=api.auth("alice")
        )
        assert decided.status_code == 200, decided.text
        late = await api.http.post(path, json={"seconds": 3600}, headers=keyed)
        assert late.status_code == 200, late.text
        assert late.headers["Idempotent-Replayed"] == "true"
        assert late.json()["approval_id"] == approval["id"]
        # As the approval stands: the deadline both extensions left.
        assert late.json()["expires_at"] == other.json()["expires_at"]
        unkeyed = await api.http.post(path, json={"seconds": 3600}, headers=api.auth("alice"))
        assert unkeyed.status_code == 409, unkeyed.text
        assert len(await _events(api, started["run_id"], "approval.extended")) == 2


async def test_a_key_must_be_one_to_255_characters(tmp_path) -> None:
    async with harness(tmp_path) as h, serve_api(h) as api:
        started = await start(api)
        approval = await pending_approval(api, started["run_id"])
        body = {"decision": "approved", "arguments_digest": approval["arguments_digest"]}
        for key in ("", "k" * 256):
            for path, sent in (
                (f"/v1/approvals/{approval['id']}/decision", body),
                (f"/v1/approvals/{approval['id']}/extend", {"seconds": 60}),
            ):
                answer = await api.http.post(
                    path, json=sent, headers={**api.auth("alice"), KEYED: key}
                )
                assert answer.status_code == 422, (path, len(key), answer.text)
        # Nothing was decided or extended by the refused requests.
        assert (await pending_approval(api, started["run_id"]))["expires_at"] == approval[
            "expires_at"
        ]


async def test_a_refused_attempt_is_not_the_answer_to_the_next(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Refused as stale ("send it again": no worker took it up in time), a
    request sent again under the same key is decided, not refused again
    (review of 2026-12-07: under one update id for the request, Temporal
    answered every attempt with the first one's refusal)."""
    stamped: list[datetime] = []

    def stale_once(message: Any, decider: Any) -> Any:
        when = datetime.now(UTC)
        if not stamped:
            when -= MAX_ATTESTATION_AGE + timedelta(minutes=1)
        stamped.append(when)
        return attest(message, decider, when)

    monkeypatch.setattr(operations, "_attested", stale_once)
    async with harness(tmp_path) as h, serve_api(h) as api:
        started, path, body = await _approval_to_decide(api)
        keyed = {**api.auth("alice"), KEYED: "approve-once"}
        refused = await api.http.post(path, json=body, headers=keyed)
        assert refused.status_code == 403 and "send it again" in refused.text, refused.text
        assert (await pending_approval(api, started["run_id"]))["status"] == "pending"
        again = await api.http.post(path, json=body, headers=keyed)
        assert again.status_code == 200, again.text
        assert again.json()["status"] == "approved"
        assert len(stamped) == 2


async def test_a_request_recorded_for_someone_else_is_not_the_callers(tmp_path) -> None:
    """Someone with Temporal access sends an extension under the request
    id of alice's (it shows in the run's history): alice's keyed request is
    refused, never answered as a replay of a change that is not hers
    (second review of 2026-12-07)."""
    async with harness(tmp_path) as h, serve_api(h) as api:
        started = await start(api, approval_timeout_seconds=600)
        approval = await pending_approval(api, started["run_id"])
        alices = operations.idempotent_request_id(
            "extend", "alice", approval["id"], "more-time", {"seconds": 3600}
        )
        squatted = await h.store.extend_approval(
            approval["id"], 60, "unattested:mallory", 3600, request_key=alices
        )
        answer = await api.http.post(
            f"/v1/approvals/{approval['id']}/extend",
            json={"seconds": 3600},
            headers={**api.auth("alice"), KEYED: "more-time"},
        )
        assert answer.status_code == 409 and "another person" in answer.text, answer.text
        assert "Idempotent-Replayed" not in answer.headers
        now = await h.store.get_approval(approval["id"])
        assert now["expires_at"] == squatted["expires_at"]


async def test_only_an_attempts_own_form_shares_its_request(tmp_path) -> None:
    """Update ids a caller chooses through Temporal that merely share a
    prefix before a "/" are two requests, two extensions; only the API's
    own "<request>/<attempt>" ids are attempts of one request."""
    from roundtable.models import ExtendInput, ExtendOutput
    from roundtable.names import EXTEND_UPDATE

    async with harness(tmp_path) as h, serve_api(h) as api:
        started = await start(api, approval_timeout_seconds=600)
        approval = await pending_approval(api, started["run_id"])
        for update_id, seconds in (("ops/1", 600), ("ops/2", 900)):
            await operations.send_update(
                h.client,
                started["run_id"],
                EXTEND_UPDATE,
                ExtendInput(approval_id=approval["id"], seconds=seconds, extended_by="ops"),
                ExtendOutput,
                update_id=update_id,
            )
        assert len(await _events(api, started["run_id"], "approval.extended")) == 2
