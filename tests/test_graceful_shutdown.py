"""SIGTERM (a deploy, `docker stop`): the worker stops taking work, lets a
write under way finish within ROUNDTABLE_SHUTDOWN_GRACE_SECONDS, and a write
still running when the grace runs out ends `unknown` through the normal
path (recorded, never replayed), not silently."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

from tests.e2e_stack import running_stack
from tests.test_e2e_durability import start_auto_write


async def _terminate_mid_write(stack, workdir: Path) -> tuple[str, int]:  # type: ignore[no-untyped-def]
    started = await start_auto_write(stack, workdir, heartbeat=10, lease=60)
    await asyncio.to_thread(stack.until, lambda: stack.cli("tickets")[1], "the write to start")
    (worker,) = stack.workers
    worker.send_signal(signal.SIGTERM)
    code = await asyncio.to_thread(worker.wait, 60)
    return started["run_id"], code


async def test_a_write_that_finishes_within_the_grace_completes(tmp_path: Path) -> None:
    async with running_stack(
        tmp_path, demo_ticket_write_delay_seconds="3", shutdown_grace_seconds="20"
    ) as stack:
        run_id, code = await _terminate_mid_write(stack, tmp_path)
        assert code == 0, (tmp_path / "worker.log").read_text()[-2000:]
        _, log = await asyncio.to_thread(stack.cli, "tickets")
        assert [w["outcome"] for w in log] == ["applied"]  # it ran to its end
        stack.start_worker()  # the run itself goes on with the next worker
        view = await asyncio.to_thread(
            stack.until, stack.run_with_status(run_id, "completed"), "completion", within=90
        )
        assert [a["status"] for a in view["actions"]] == ["succeeded"]


async def test_a_write_still_running_after_the_grace_ends_unknown(tmp_path: Path) -> None:
    async with running_stack(
        tmp_path, demo_ticket_write_delay_seconds="30", shutdown_grace_seconds="1"
    ) as stack:
        run_id, code = await _terminate_mid_write(stack, tmp_path)
        assert code == 0, (tmp_path / "worker.log").read_text()[-2000:]
        # Recorded by the worker on its way out, before any other worker ran.
        code, view = await asyncio.to_thread(stack.cli, "show", run_id)
        assert code == 0
        (action,) = view["actions"]
        assert action["status"] == "unknown", action
        assert action["attempt_count"] == 1
        stack.start_worker()
        await asyncio.to_thread(
            stack.until, stack.run_with_status(run_id, "waiting_input"), "waiting", within=60
        )
        _, log = await asyncio.to_thread(stack.cli, "tickets")
        assert len(log) == 1  # never replayed
