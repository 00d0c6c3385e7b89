"""`roundtable start --wait` directly on the database and Temporal: the run id
at once, then each approval it waits for with the command that decides it."""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import subprocess
import threading
from pathlib import Path

from tests.dev_stack import CLI
from tests.test_api import ONE_WRITE
from tests.workflow_harness import harness


async def test_start_wait_tells_each_approval_and_its_command_works(tmp_path: Path) -> None:
    async with harness(tmp_path) as h:
        env = {
            **os.environ,
            "ROUNDTABLE_DATABASE_URL": f"sqlite+aiosqlite:///{tmp_path / 'roundtable.db'}",
            "ROUNDTABLE_TEMPORAL_ADDRESS": h.client.service_client.config.target_host,
            "ROUNDTABLE_TASK_QUEUE": h.task_queue,
        }
        env.pop("ROUNDTABLE_API_URL", None)
        run_script = tmp_path / "script.json"
        run_script.write_text(json.dumps(ONE_WRITE))
        waiting = subprocess.Popen(  # noqa: ASYNC220 (read by a thread below)
            [CLI, "start", "--task", "t", "--script", str(run_script), "--wait"],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        said: list[str] = []
        reader = threading.Thread(target=lambda: said.extend(iter(waiting.stdout.readline, "")))
        reader.start()
        try:
            for _ in range(600):
                told = [line for line in said if line.startswith("  approve: ")]
                if told or waiting.poll() is not None:
                    break
                await asyncio.sleep(0.1)
            assert told, "".join(said) + waiting.stderr.read()
            assert said[0].startswith("started run run-"), said
            # The commands act on the database and Temporal these settings
            # name, some relative to this directory: said once, before them.
            (noted,) = [line for line in said if "act on the database" in line]
            assert said.index(noted) < said.index(next(s for s in said if "approve:" in s))
            assert str(tmp_path) in noted and "same ROUNDTABLE_* settings" in noted, noted
            assert any(
                line.startswith("waiting for approval: ticket_update by seat-1") for line in said
            )
            decided = await asyncio.to_thread(
                subprocess.run,
                shlex.split(told[0].removeprefix("  approve: ")),
                cwd=tmp_path,
                env=env,
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            assert decided.returncode == 0, decided.stdout + decided.stderr
            await asyncio.to_thread(waiting.wait, 90)
        finally:
            if waiting.poll() is None:
                waiting.kill()
            await asyncio.to_thread(reader.join, 10)
        assert waiting.returncode == 0, "".join(said)
        run_id = said[0].split()[-1]
        assert f"run {run_id} completed\n" in said
        assert said[-1] == "final answer: done\n"
