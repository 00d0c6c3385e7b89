"""The short chaos run (issue 10): the whole stack under every fault kind for
a couple of minutes on SQLite, then the invariant checker and the canary scan.
`make chaos` runs the long one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SHORT_SECONDS = "100"


@pytest.mark.timeout(580)
def test_a_short_chaos_run_keeps_every_promise(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "chaos",
            "--seed",
            "7",
            "--duration",
            SHORT_SECONDS,
            "--workdir",
            str(tmp_path / "chaos"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=560,
        check=False,
    )
    tail = (done.stdout + done.stderr)[-6000:]
    assert done.returncode == 0, tail
    assert " violations=0" in done.stdout, tail
    assert "CANARY LEAK" not in done.stdout, tail
    assert "NOT INJECTED" not in done.stdout, tail
