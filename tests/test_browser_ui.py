"""An SRE opens a run in the Temporal UI: headless Chromium (Debian's) shows
its payloads decoded through the API's codec endpoint, though Temporal itself
holds only ciphertext. The screenshot is kept in test-artifacts/."""

from __future__ import annotations

import asyncio
import base64
import json
import subprocess
from pathlib import Path

from tests.browser import ARTIFACTS, CHROMIUM, FLAGS, require_browser
from tests.dev_stack import dev_stack
from tests.temporal_servers import venv_binary

DEMO_TASK = "Triage ticket acme/T-100"


def _inspect(address: str, workflow_id: str) -> tuple[str, str]:
    """The run id, and the raw history as Temporal stores it (no codec)."""
    temporal = venv_binary("temporal")
    described = subprocess.run(
        [
            temporal,
            "workflow",
            "describe",
            "--address",
            address,
            "-w",
            workflow_id,
            "--output",
            "json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    raw = subprocess.run(
        [temporal, "workflow", "show", "--address", address, "-w", workflow_id, "--output", "json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    run_id = json.loads(described.stdout)["workflowExecutionInfo"]["execution"]["runId"]
    return run_id, raw.stdout


async def test_temporal_ui_shows_decoded_payloads(tmp_path: Path) -> None:
    require_browser()
    from playwright.async_api import async_playwright

    with dev_stack(tmp_path) as stack:
        (run_id,) = stack.wait_for(r"demo run started: (demo-\S+)")
        stack.wait_for(r"waiting for approval")
        execution_run_id, raw = await asyncio.to_thread(_inspect, f"127.0.0.1:{stack.port}", run_id)
        where = raw.find(DEMO_TASK)
        assert where < 0, raw[max(0, where - 600) : where + 200]
        # Ciphertext at rest (the CLI prints metadata values base64-encoded).
        assert base64.b64encode(b"binary/encrypted").decode() in raw

        url = (
            f"http://127.0.0.1:{stack.ui_port}/namespaces/default/workflows/"
            f"{run_id}/{execution_run_id}/history"
        )
        async with async_playwright() as playwright:
            browser = await playwright.chromium.launch(
                executable_path=CHROMIUM,
                args=FLAGS,
            )
            try:
                page = await browser.new_page(viewport={"width": 1400, "height": 1600})
                await page.goto(url)
                await page.get_by_text(DEMO_TASK).first.wait_for(timeout=30_000)
                ARTIFACTS.mkdir(exist_ok=True)
                await page.screenshot(path=str(ARTIFACTS / "temporal-ui-run.png"), full_page=True)
                body = await page.inner_text("body")
            finally:
                await browser.close()
        assert DEMO_TASK in body
        assert "RoundtableWorkflow" in body
