"""Who holds a local TCP port (Linux), so a stack that cannot start says
which process is in its way instead of failing later, or worse, talking to
what an earlier, killed stack left behind."""

from __future__ import annotations

import os
from pathlib import Path

_TABLES = (Path("/proc/net/tcp"), Path("/proc/net/tcp6"))
_LISTEN = "0A"


def _listening_inodes(port: int) -> set[str]:
    inodes = set()
    for table in _TABLES:
        try:
            lines = table.read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == _LISTEN:
                if int(fields[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(fields[9])
    return inodes


def _pid_with(inodes: set[str]) -> int | None:
    wanted = {f"socket:[{inode}]" for inode in inodes}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            for fd in (entry / "fd").iterdir():
                if os.readlink(fd) in wanted:
                    return int(entry.name)
        except OSError:  # gone, or not ours to read
            continue
    return None


def port_holder(port: int) -> str | None:
    """ "pid N (command line)" of the process listening on ``port``; "another
    user's process" when it is not ours to read; None when nothing listens."""
    inodes = _listening_inodes(port)
    if not inodes:
        return None
    pid = _pid_with(inodes)
    if pid is None:
        return "another user's process"
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").strip()
    except OSError:
        command = b"?"
    return f"pid {pid} ({command.decode(errors='replace')[:200]})"
