"""The worker's tuning is configuration: read from the environment, handed
to temporalio's Worker, refused with a clear error when it makes no sense."""

from __future__ import annotations

from datetime import timedelta

import pytest
from pydantic import ValidationError

from roundtable.config import Settings
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
    ],
)
def test_nonsense_is_refused_by_name(monkeypatch, name: str, value: str) -> None:
    monkeypatch.setenv(f"ROUNDTABLE_{name}", value)
    with pytest.raises(ValidationError, match=name.lower()):
        Settings()
