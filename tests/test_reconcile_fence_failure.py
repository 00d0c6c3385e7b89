"""Reconciling "failed" when the tool's fence fails (review of 2026-12-07).

Before "failed" is written, the tool's fence is raised with the action's
decrypted arguments. A fence that raises (its system down, or answering with
an error that quotes the request) is answered at once, as a refusal that
records nothing, and what it said is redacted of the action's arguments as
execute_write redacts a tool's errors: it used to reach the operator's 409
and the worker's log as it was, and, inside a run's workflow, to be retried
for as long as the attestation lived (ten minutes) with no answer meanwhile.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

import pytest

from roundtable import operations
from roundtable.store import ConflictError
from tests.api_server import serve_api
from tests.test_closed_runs import AUTO, update
from tests.test_worker_roles import lost_before_acting
from tests.test_workflow_execution import wrap_tool
from tests.workflow_harness import harness, script, ticket_call

SECRET = "card 4111-1111-1111-1111 exp 09/29"
ANSWER_WITHIN = 60  # seconds before the test gives up waiting (never a timing)


def fence_raising(tool_name: str, error: Exception | None = None):  # type: ignore[no-untyped-def]
    """The tool's first call is lost before it acted (the action ends
    unknown); its fence raises ``error``, or one quoting its request."""

    def customize(registry: Any, _tickets: Any) -> None:
        wrap_tool(registry, tool_name, lost_before_acting)
        tool = registry.tools[tool_name]
        calls: list[Any] = []

        async def fence(args: Any, ctx: Any) -> bool:
            calls.append(ctx.fencing_token)
            raise error or RuntimeError(f"service answered 503 to {args.model_dump_json()}")

        registry.tools[tool_name] = dataclasses.replace(tool, fence=fence)
        registry.fence_calls = calls  # type: ignore[attr-defined]

    return customize


def _logged(record: logging.LogRecord) -> str:
    text = record.getMessage()
    if record.exc_info and record.exc_info[1] is not None:
        error = record.exc_info[1]
        text += f"{error!r} {error.__cause__!r} {error.__context__!r}"
    return text


@pytest.mark.parametrize("run_state", ["open", "terminated"])
async def test_what_a_failing_fence_says_reaches_nobody_with_the_arguments(
    tmp_path, caplog, run_state: str
) -> None:
    caplog.set_level(logging.DEBUG)
    async with (
        harness(tmp_path, customize=fence_raising("ticket_comment")) as h,
        serve_api(h) as api,
    ):
        run = script(("seat-1", 1, [ticket_call("ticket_comment", "T-1", body=SECRET)]))
        handle = await h.start(task_text="t", script=run, write_policy=AUTO)
        state = await h.wait_for(handle, lambda s: bool(s.unknown_actions))
        (action_id,) = state.unknown_actions
        if run_state == "terminated":
            await handle.terminate(reason="stuck, said the on-call")
        answer = await api.http.post(
            f"/v1/actions/{action_id}/reconcile",
            headers=api.auth("ops"),
            json={"outcome": "failed", "note": "the ticket shows no comment"},
        )
        events = await h.store.list_events(handle.id)
        action = await h.store.get_action(action_id)
        if run_state == "open":
            await handle.terminate(reason="test done")
    assert answer.status_code == 409, answer.text
    assert "fence failed" in answer.json()["detail"]
    assert "[redacted]" in answer.json()["detail"]  # what it said, less the body
    assert action["status"] == "unknown"  # nothing recorded
    assert h.registry.fence_calls == [1]  # type: ignore[attr-defined]
    assert "4111" not in answer.text
    assert "4111" not in str(events)
    assert not [r.getMessage()[:200] for r in caplog.records if "4111" in _logged(r)]


async def test_a_fence_whose_system_is_down_is_answered_at_once_not_retried(tmp_path) -> None:
    down = fence_raising("ticket_update", ConnectionError("ticket system unreachable"))
    async with harness(tmp_path, customize=down) as h:
        handle = await h.start(task_text="t", script=update(), write_policy=AUTO)
        state = await h.wait_for(handle, lambda s: bool(s.unknown_actions))
        (action_id,) = state.unknown_actions
        asking = operations.reconcile(
            h.client, h.store, action_id, "failed", "op-1", "nothing landed", h.task_queue
        )
        with pytest.raises(ConflictError, match=r"fence failed.*ConnectionError.*unreachable"):
            await asyncio.wait_for(asking, ANSWER_WITHIN)
        action = await h.store.get_action(action_id)
        assert action["status"] == "unknown"
        assert h.registry.fence_calls == [1]  # type: ignore[attr-defined]
        # Once the system answers, the operator's second try stands.
        h.registry.tools["ticket_update"] = dataclasses.replace(
            h.registry.tools["ticket_update"], fence=_fences
        )
        done = await operations.reconcile(
            h.client, h.store, action_id, "failed", "op-1", "nothing landed", h.task_queue
        )
        assert done["status"] == "failed"
        await handle.terminate(reason="test done")


async def _fences(args: Any, ctx: Any) -> bool:
    return True


class PayloadError(Exception):
    """As some clients' errors: the request it failed on as its message,
    which ``str()`` cannot even render."""

    def __str__(self) -> str:
        return self.args[0]  # type: ignore[no-any-return]


async def _never_answers(args: Any, ctx: Any) -> bool:
    await asyncio.Event().wait()
    return True


@pytest.mark.parametrize("failure", ["unreadable message", "no answer", "arguments unopened"])
async def test_every_way_a_fence_can_fail_is_a_refusal_at_once_that_quotes_nothing(
    tmp_path, caplog, monkeypatch, failure: str
) -> None:
    import activities.write_activities as writes
    from roundtable.security import ArgumentsDecryptionError

    caplog.set_level(logging.DEBUG)
    monkeypatch.setattr(writes, "FENCE_WITHIN", writes.timedelta(seconds=1))
    async with harness(
        tmp_path, customize=fence_raising("ticket_comment", PayloadError({"body": SECRET}))
    ) as h:
        run = script(("seat-1", 1, [ticket_call("ticket_comment", "T-1", body=SECRET)]))
        handle = await h.start(task_text="t", script=run, write_policy=AUTO)
        state = await h.wait_for(handle, lambda s: bool(s.unknown_actions))
        (action_id,) = state.unknown_actions
        if failure == "no answer":
            h.registry.tools["ticket_comment"] = dataclasses.replace(
                h.registry.tools["ticket_comment"], fence=_never_answers
            )
        if failure == "arguments unopened":

            async def unopened(_action_id: str) -> Any:
                raise ArgumentsDecryptionError("sealed under a different secret")

            monkeypatch.setattr(h.store, "get_action_arguments", unopened)
        asking = operations.reconcile(
            h.client, h.store, action_id, "failed", "op-1", "nothing landed", h.task_queue
        )
        with pytest.raises(ConflictError) as refused:
            await asyncio.wait_for(asking, ANSWER_WITHIN)
        action = await h.store.get_action(action_id)
        await handle.terminate(reason="test done")
    said = {
        "unreadable message": "PayloadError: (its message could not be read)",
        "no answer": "no answer within 1 s",
        "arguments unopened": "different secret",
    }[failure]
    assert said in str(refused.value)
    assert action["status"] == "unknown"
    assert "4111" not in str(refused.value)
    assert not [r.getMessage()[:200] for r in caplog.records if "4111" in _logged(r)]
