"""The Temporal servers tests run on, started offline from the virtualenv's
binaries and given time to come up.

The SDK waits five seconds for a server it starts. On a loaded 2-core CI
machine the dev server has missed that (a CI run failed on "did not start
within 5s"), so every test starts its servers here, with the minute the
product's own `roundtable dev` allows."""

from __future__ import annotations

import shutil
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

from temporalio.testing import WorkflowEnvironment

STARTUP_WAIT = timedelta(seconds=60)


def venv_binary(name: str) -> str:
    """Offline: the SDK must never try to download a server."""
    candidate = Path(sys.executable).parent / name
    found = str(candidate) if candidate.exists() else shutil.which(name)
    assert found is not None, f"{name} not found; install the dev extras (make test does)"
    return found


async def start_dev_server(**options: Any) -> WorkflowEnvironment:
    """``temporal server start-dev``, headless; ``options`` go to
    ``WorkflowEnvironment.start_local``."""
    return await WorkflowEnvironment.start_local(
        dev_server_existing_path=venv_binary("temporal"),
        dev_server_startup_timeout=STARTUP_WAIT,
        ui=False,
        **options,
    )


async def start_test_server(**options: Any) -> WorkflowEnvironment:
    """The time-skipping test server; ``options`` go to
    ``WorkflowEnvironment.start_time_skipping``."""
    return await WorkflowEnvironment.start_time_skipping(
        test_server_existing_path=venv_binary("temporal-test-server"),
        test_server_startup_timeout=STARTUP_WAIT,
        **options,
    )
