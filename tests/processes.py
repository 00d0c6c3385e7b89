"""What the tests read of a local process (Linux /proc)."""

from __future__ import annotations

from pathlib import Path


def running(pid: int) -> bool:
    """Whether the process exists and has not exited (a zombie has)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")
