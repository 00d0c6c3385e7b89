"""What the worker logs: JSON lines carrying the ids they concern, and
expected outcomes (a refused reconciliation, a model retry) as one line each,
never a traceback."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from temporalio.client import WorkflowUpdateFailedError

from roundtable.telemetry.logs import handler
from tests.fake_openai import error, fake_openai, message
from tests.test_closed_runs import AUTO, acts_then_raises, update
from tests.test_workflow_execution import reconcile, wrap_tool
from tests.workflow_harness import harness


@contextmanager
def captured(log_format: str) -> Iterator[io.StringIO]:
    """The process's log, in ``log_format``, at INFO."""
    out = io.StringIO()
    made = handler(log_format, out)
    root = logging.getLogger()
    level = root.level
    root.addHandler(made)
    root.setLevel(logging.INFO)
    try:
        yield out
    finally:
        root.removeHandler(made)
        root.setLevel(level)


def lines(out: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in out.getvalue().splitlines()]


async def test_a_refused_reconciliation_is_one_json_line_with_its_ids(tmp_path) -> None:
    customize = lambda reg, _t: wrap_tool(reg, "ticket_update", acts_then_raises)  # noqa: E731
    with captured("json") as out:
        async with harness(tmp_path, customize=customize) as h:
            lost = await h.start(task_text="t", script=update("T-1", "a"), write_policy=AUTO)
            state = await h.wait_for(lost, lambda s: bool(s.unknown_actions))
            (action_id,) = state.unknown_actions
            # The ticket's fence saw the write applied: "failed" is refused.
            with pytest.raises(WorkflowUpdateFailedError):
                await reconcile(lost, action_id, "failed")
    logged = lines(out)  # every line is one JSON object
    refusals = [line for line in logged if "refused" in line["message"]]
    assert len(refusals) == 1, refusals
    (refusal,) = refusals
    assert refusal["logger"] == "roundtable.activities" and refusal["level"] == "info"
    assert refusal["run_id"] == lost.id and refusal["action_id"] == action_id
    assert "reconcile_action" in refusal["message"]
    # Nothing logged a traceback, at any level we show.
    assert not any("error" in line for line in logged), [x for x in logged if "error" in x]
    assert "Traceback" not in out.getvalue()


async def test_a_model_retry_is_one_warning_line(tmp_path, monkeypatch) -> None:
    def replies(_body: dict, n: int) -> dict:
        # The SDK's own retries (3 calls) fail, then Temporal's next attempt works.
        return error(503) if n <= 3 else message("done")

    with captured("plain") as out:
        async with fake_openai(replies) as fake, harness(tmp_path) as h:
            monkeypatch.setenv("OPENAI_BASE_URL", fake.base_url)
            monkeypatch.setenv("OPENAI_API_KEY", "sk-test-not-real")
            handle = await h.start(
                task_text="t", model="openai:m", seats=["seat-1"], manager=None, max_rounds=1
            )
            assert (await handle.result()).status == "completed"
    said = out.getvalue()
    retries = [line for line in said.splitlines() if "model endpoint answered 503" in line]
    assert len(retries) == 1, said
    assert " WARNING roundtable.model " in retries[0] and f"run_id={handle.id}" in retries[0]
    assert "Traceback" not in said


def test_an_unknown_log_format_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="ROUNDTABLE_LOG_FORMAT must be plain or json"):
        handler("xml")
