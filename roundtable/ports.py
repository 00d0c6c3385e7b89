"""Who holds a local TCP port (Linux), so a stack that cannot start says
which process is in its way instead of failing later, or worse, talking to
what an earlier, killed stack left behind."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

TCP_TABLES = (Path("/proc/net/tcp"), Path("/proc/net/tcp6"))
_LISTEN = "0A"


@dataclass(frozen=True)
class TcpSocket:
    """One row of the kernel's TCP table (addresses as the kernel prints them)."""

    local: str
    local_port: int
    remote: str
    remote_port: int
    state: str  # "01" established, "0A" listening
    uid: int
    inode: str


def tcp_sockets() -> Iterator[TcpSocket]:
    """Every TCP socket the kernel lists, IPv4 and IPv6 (none where there is no /proc)."""
    for table in TCP_TABLES:
        try:
            lines = table.read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10:
                continue
            local, local_port = fields[1].rsplit(":", 1)
            remote, remote_port = fields[2].rsplit(":", 1)
            yield TcpSocket(
                local,
                int(local_port, 16),
                remote,
                int(remote_port, 16),
                fields[3],
                int(fields[7]),
                fields[9],
            )


def _listening_inodes(port: int) -> set[str]:
    return {s.inode for s in tcp_sockets() if s.state == _LISTEN and s.local_port == port}


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


def free_port() -> int:
    """A loopback port nothing listens on now (the kernel's pick; whoever
    binds it next may still lose a race, and then says so)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
