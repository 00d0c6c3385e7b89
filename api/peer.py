"""Who is on the other end of a loopback connection (Linux only).

The kernel lists every TCP socket with the uid that owns it in
/proc/net/tcp and /proc/net/tcp6. For a connection from this machine, the
client's own socket is the row whose local port is the client's port and
whose remote port is ours.
"""

from __future__ import annotations

from roundtable.ports import TCP_TABLES, tcp_sockets

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
    owners = {
        s.uid
        for s in tcp_sockets()
        if s.state == _ESTABLISHED
        and s.local_port == client_port
        and s.remote_port == server_port
        and _loopback(s.local)
        and _loopback(s.remote)
    }
    return owners.pop() if len(owners) == 1 else None


def socket_owners_listed() -> bool:
    """Whether this system lists socket owners (Linux does; macOS does not)."""
    return TCP_TABLES[0].exists()
