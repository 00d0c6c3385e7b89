"""Headless Chromium for the browser tests: where it is, how it starts on
this closed network, and where screenshots go."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

from tests.ci import unavailable

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"

# Without the background-networking flags Chromium's own connections are
# refused by this machine's closed network, many at a time.
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def require_browser() -> None:
    """Chromium and playwright, or the test fails in CI (skips elsewhere)."""
    missing = []
    if not Path(CHROMIUM).exists():
        missing.append("Debian's chromium")
    if importlib.util.find_spec("playwright") is None:
        missing.append("the playwright package")
    if missing:
        unavailable(" and ".join(missing), "make test installs them")
