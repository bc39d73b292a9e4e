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

__all__ = ["local_peer_uid", "parse_endpoint", "kernel_form", "TABLES"]

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


def kernel_form(address: str, port: int) -> list[str]:
    """How the kernel's tables write ``address:port``: an IPv4 address as in ``/proc/net/tcp``
    and, mapped into IPv6, as in ``/proc/net/tcp6``; an IPv6 address as in ``/proc/net/tcp6``."""
    parsed = ipaddress.ip_address(_plain(address))
    forms: list[ipaddress.IPv4Address | ipaddress.IPv6Address] = [parsed]
    if isinstance(parsed, ipaddress.IPv4Address):
        forms.append(ipaddress.IPv6Address(f"::ffff:{parsed}"))
    written = []
    for each in forms:
        raw = each.packed
        ordered = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
        written.append(f"{ordered.hex().upper()}:{port:04X}")
    return written


def _uid_in(lines: Iterable[str], pairs: set[tuple[str, str]]) -> int | None:
    for line in lines:
        fields = line.split(None, 8)
        if len(fields) >= 8 and (fields[1], fields[2]) in pairs:
            return int(fields[7])
    return None


def local_peer_uid(conn: socket.socket, tables: Iterable[str] = TABLES) -> int | None:
    """The user id of the process on this machine that made ``conn`` (an accepted TCP
    connection), or None when its client socket is not in this machine's tables (another
    machine, or a client that is gone). Compares the tables' own text: no line is parsed."""
    peer_address, peer_port = conn.getpeername()[:2]
    local_address, local_port = conn.getsockname()[:2]
    pairs = {(p, q) for p in kernel_form(peer_address, peer_port) for q in kernel_form(local_address, local_port)}
    for table in tables:
        try:
            with open(table) as fh:
                found = _uid_in(fh, pairs)
        except OSError:
            continue
        if found is not None:
            return found
    return None
