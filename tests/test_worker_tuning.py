"""The worker's tuning is configuration: read from the environment, handed
to temporalio's Worker, refused with a clear error when it makes no sense."""

from __future__ import annotations

from datetime import timedelta

import pytest
from pydantic import ValidationError

from roundtable.config import Settings
from roundtable.models import WorkflowArgs
from worker import tuning


def test_unset_settings_keep_the_sdks_defaults_and_ours() -> None:
    assert tuning(Settings()) == {
        "sticky_queue_schedule_to_start_timeout": timedelta(seconds=1),
        "graceful_shutdown_timeout": timedelta(seconds=30),
    }


def test_settings_from_the_environment_reach_the_worker(monkeypatch) -> None:
    for name, value in {
        "WORKER_MAX_CONCURRENT_ACTIVITIES": "40",
        "WORKER_MAX_CONCURRENT_LOCAL_ACTIVITIES": "20",
        "WORKER_MAX_CONCURRENT_WORKFLOW_TASKS": "10",
        "WORKER_MAX_CACHED_WORKFLOWS": "0",
        "WORKER_STICKY_QUEUE_TIMEOUT_SECONDS": "2.5",
        "SHUTDOWN_GRACE_SECONDS": "90",
    }.items():
        monkeypatch.setenv(f"ROUNDTABLE_{name}", value)
    assert tuning(Settings()) == {
        "max_concurrent_activities": 40,
        "max_concurrent_local_activities": 20,
        "max_concurrent_workflow_tasks": 10,
        "max_cached_workflows": 0,
        "sticky_queue_schedule_to_start_timeout": timedelta(seconds=2.5),
        "graceful_shutdown_timeout": timedelta(seconds=90),
    }


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("WORKER_MAX_CONCURRENT_ACTIVITIES", "0"),
        ("WORKER_MAX_CONCURRENT_WORKFLOW_TASKS", "1"),  # the SDK needs two
        ("WORKER_STICKY_QUEUE_TIMEOUT_SECONDS", "0"),
        ("SHUTDOWN_GRACE_SECONDS", "-1"),
        ("WORKER_MAX_CACHED_WORKFLOWS", "many"),
        ("WORKER_GC_THRESHOLDS", "0,10,10"),  # 0 would turn collection off
        ("WORKER_GC_THRESHOLDS", "20000,20"),
        ("WORKER_GC_THRESHOLDS", "20000,20,-1"),
        ("WORKER_GC_THRESHOLDS", "many,20,20"),
    ],
)
def test_nonsense_is_refused_by_name(monkeypatch, name: str, value: str) -> None:
    monkeypatch.setenv(f"ROUNDTABLE_{name}", value)
    with pytest.raises(ValidationError, match=name.lower()):
        Settings()


def test_the_garbage_collectors_thresholds_are_three_numbers_or_pythons_own(
    monkeypatch,
) -> None:
    assert Settings().gc_thresholds() is None  # Python's own unless set
    monkeypatch.setenv("ROUNDTABLE_WORKER_GC_THRESHOLDS", " 5000, 10 ,10 ")
    assert Settings().gc_thresholds() == (5000, 10, 10)
    monkeypatch.setenv("ROUNDTABLE_WORKER_GC_THRESHOLDS", "")
    assert Settings().gc_thresholds() is None  # Python's own: left as they are


def test_a_heartbeat_that_outlasts_the_lease_is_refused() -> None:
    with pytest.raises(ValidationError, match="must be shorter than ROUNDTABLE_RUN_LEASE"):
        Settings(run_lease_seconds=20)  # the default heartbeat is 20 s
    with pytest.raises(ValidationError, match="must be shorter than ROUNDTABLE_RUN_LEASE"):
        Settings(run_lease_seconds=60, run_heartbeat_timeout_seconds=60)
    assert Settings(run_lease_seconds=90, run_heartbeat_timeout_seconds=45).run_lease_seconds == 90


async def test_the_servers_lease_and_heartbeat_reach_runs_that_set_none(tmp_path) -> None:
    """Through the real API: a run naming no lease gets the server's; one
    naming its own keeps it; a mix that cannot work is refused (422)."""
    from tests.api_server import serve_api
    from tests.test_api import start
    from tests.workflow_harness import harness

    async with (
        harness(tmp_path) as h,
        serve_api(h, run_lease_seconds=90, run_heartbeat_timeout_seconds=45) as api,
    ):
        chosen = await start(api)
        own = await start(api, lease_seconds=12, heartbeat_timeout_seconds=4)
        refused = await api.http.post(
            "/v1/runs",
            # Valid alone, but not with the server's 45-s heartbeat.
            json={"task_text": "t", "lease_seconds": 40},
            headers=api.auth("alice"),
        )
        assert refused.status_code == 422, refused.text
        assert "heartbeat_timeout_seconds (45) must be shorter than lease_seconds (40)" in (
            refused.text
        )
        requests = []
        for started in (chosen, own):
            handle = h.client.get_workflow_handle(started["run_id"])
            first = await anext(aiter(handle.fetch_history_events()))
            (payload,) = first.workflow_execution_started_event_attributes.input.payloads
            (args,) = await h.client.data_converter.decode([payload], [WorkflowArgs])
            requests.append(args.request)
    assert (requests[0].lease_seconds, requests[0].heartbeat_timeout_seconds) == (90, 45)
    assert (requests[1].lease_seconds, requests[1].heartbeat_timeout_seconds) == (12, 4)
