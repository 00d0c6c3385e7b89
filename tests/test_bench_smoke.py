"""The short form of `make bench`: every figure of the approval benchmark is
produced (a handful of approvals; no timing is judged here, only that the
measurement works end to end)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(240)
def test_the_approval_benchmark_produces_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "latest.json"
    done = subprocess.run(
        [sys.executable, "-m", "bench.approvals", "--approvals", "3", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=220,
        check=False,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    figures = json.loads(out.read_text())
    for key in ("update", "write", "result"):
        for side in ("bare", "ours"):
            assert figures[key][side]["p50_ms"] > 0 and figures[key][side]["p95_ms"] > 0
        assert figures[key]["ratio_p50"] > 0
    history = figures["history_events"]
    assert history["ours_per_approved_write"] > 0 and history["bare_workflow"] > 0
    assert "history events:" in done.stdout
