"""Who is on the other end of a loopback connection (Linux only).

The kernel lists every TCP socket with the uid that owns it in
/proc/net/tcp and /proc/net/tcp6. For a connection from this machine, the
client's own socket is the row whose local port is the client's port and
whose remote port is ours.
"""

from __future__ import annotations

from pathlib import Path

_TABLES = (Path("/proc/net/tcp"), Path("/proc/net/tcp6"))
_ESTABLISHED = "01"
# Loopback addresses as the kernel prints them (32-bit words, little-endian):
# 127.x.x.x, ::1 and ::ffff:127.x.x.x.
_IPV6_LOOPBACK = "00000000000000000000000001000000"
_MAPPED_PREFIX = "0000000000000000FFFF0000"


def _loopback(address: str) -> bool:
    if len(address) == 8:
        return address.endswith("7F")
    return address == _IPV6_LOOPBACK or (
        address.startswith(_MAPPED_PREFIX) and address.endswith("7F")
    )


def peer_uid(client_port: int, server_port: int) -> int | None:
    """The uid owning the client end of a loopback TCP connection from
    ``client_port`` to ``server_port``; None if no such socket is listed, or
    if sockets of several owners match (never guess)."""
    owners: set[int] = set()
    for table in _TABLES:
        try:
            lines = table.read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 8 or fields[3] != _ESTABLISHED:
                continue
            local, local_port = fields[1].rsplit(":", 1)
            remote, remote_port = fields[2].rsplit(":", 1)
            if (
                int(local_port, 16) == client_port
                and int(remote_port, 16) == server_port
                and _loopback(local)
                and _loopback(remote)
            ):
                owners.add(int(fields[7]))
    return owners.pop() if len(owners) == 1 else None


def socket_owners_listed() -> bool:
    """Whether this system lists socket owners (Linux does; macOS does not)."""
    return _TABLES[0].exists()
