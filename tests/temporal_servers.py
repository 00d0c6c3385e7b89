"""The Temporal servers tests run on, started offline from the virtualenv's
binaries and given time to come up.

The SDK waits five seconds for a server it starts. On a loaded 2-core CI
machine the dev server has missed that (a CI run failed on "did not start
within 5s"), so every test starts its servers here, with the minute the
product's own `roundtable dev` allows.

A dev server that does not come up is started again, as `roundtable dev`
starts its own again (roundtable/cli/stack.py): `start-dev` chooses its HTTP
API and metrics ports itself and binds them a moment later, and a port
another process took in between makes it exit (a CI run of `roundtable dev`
lost such a race). The SDK cannot say why a server did not come up (it
stops it and reports the wait it ran out of), so any such start is tried
again: a server that cannot start at all (a flag it refuses, say) fails its
test after three startup waits instead of one. Any other error (no such
binary) is raised at once."""

from __future__ import annotations

import functools
import shutil
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

from temporalio.testing import WorkflowEnvironment

STARTUP_WAIT = timedelta(seconds=60)
# Starts of a dev server before its failure is the test's.
DEV_SERVER_STARTS = 3


def venv_binary(name: str) -> str:
    """Offline: the SDK must never try to download a server."""
    candidate = Path(sys.executable).parent / name
    found = str(candidate) if candidate.exists() else shutil.which(name)
    assert found is not None, f"{name} not found; install the dev extras (make test does)"
    return found


async def start_dev_server(
    *, binary: str | None = None, startup_wait: timedelta = STARTUP_WAIT, **options: Any
) -> WorkflowEnvironment:
    """``temporal server start-dev``, headless; ``options`` go to
    ``WorkflowEnvironment.start_local``. ``binary`` and ``startup_wait``:
    for the test of the retry itself."""
    start_local = functools.partial(
        WorkflowEnvironment.start_local,
        dev_server_existing_path=binary or venv_binary("temporal"),
        dev_server_startup_timeout=startup_wait,
        ui=False,
        **options,
    )
    for start in range(1, DEV_SERVER_STARTS):
        try:
            return await start_local()
        except RuntimeError as failed:
            if "did not start within" not in str(failed):
                raise
            print(
                f"dev server did not come up (start {start} of {DEV_SERVER_STARTS}): {failed}; "
                "starting it again",
                file=sys.stderr,
            )
    return await start_local()


async def start_test_server(**options: Any) -> WorkflowEnvironment:
    """The time-skipping test server; ``options`` go to
    ``WorkflowEnvironment.start_time_skipping``."""
    return await WorkflowEnvironment.start_time_skipping(
        test_server_existing_path=venv_binary("temporal-test-server"),
        test_server_startup_timeout=STARTUP_WAIT,
        **options,
    )
