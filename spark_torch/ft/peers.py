"""Who is at the other end of a TCP connection from this host (:func:`local_peer_uid`).

A connection made on this machine (over loopback or any of its addresses) has its client socket
in the kernel's table of this network namespace (``/proc/net/tcp``, ``/proc/net/tcp6``), with
the user id of the process that made it: the same check ``SO_PEERCRED`` gives a Unix socket.
A connection from another machine has no such entry.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable

__all__ = ["local_peer_uid", "parse_endpoint", "TABLES"]

#: the kernel's tables of this namespace's TCP sockets
TABLES = ("/proc/net/tcp", "/proc/net/tcp6")

Endpoint = tuple[str, int]


def _plain(address: str) -> str:
    """An address as :mod:`ipaddress` writes it, an IPv4 address mapped into IPv6 as IPv4."""
    parsed = ipaddress.ip_address(address.split("%", 1)[0])
    mapped = getattr(parsed, "ipv4_mapped", None)
    return str(mapped) if mapped is not None else str(parsed)


def parse_endpoint(text: str) -> Endpoint:
    """``0100007F:1F90`` (the kernel's hex, each 32-bit word in host order) as ``("127.0.0.1", 8080)``."""
    hex_address, hex_port = text.split(":")
    raw = bytes.fromhex(hex_address)
    ordered = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return _plain(str(ipaddress.ip_address(ordered))), int(hex_port, 16)


def _uid_in(lines: Iterable[str], peer: Endpoint, local: Endpoint) -> int | None:
    for line in lines:
        fields = line.split()
        if len(fields) < 8 or ":" not in fields[1]:
            continue  # the header
        try:
            if parse_endpoint(fields[1]) == peer and parse_endpoint(fields[2]) == local:
                return int(fields[7])
        except ValueError:
            continue
    return None


def local_peer_uid(conn: socket.socket, tables: Iterable[str] = TABLES) -> int | None:
    """The user id of the process on this machine that made ``conn`` (an accepted TCP
    connection), or None when its client socket is not in this machine's tables (another
    machine, or a client that is gone)."""
    peer_address, peer_port = conn.getpeername()[:2]
    local_address, local_port = conn.getsockname()[:2]
    peer, local = (_plain(peer_address), peer_port), (_plain(local_address), local_port)
    for table in tables:
        try:
            with open(table) as fh:
                found = _uid_in(fh, peer, local)
        except OSError:
            continue
        if found is not None:
            return found
    return None
