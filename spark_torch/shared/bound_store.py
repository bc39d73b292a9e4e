"""torch's ``TCPStore`` server on one address only: the node's store host
(:mod:`spark_torch.node.store_host_main`) and rank 0 when the node did not host it
(:mod:`spark_torch.rank.store`; a replica group's rank 0 too) host the rendezvous store this way. torch's own server
listens on every interface and has no
authentication; here the socket is bound to ``host`` first and handed to torch
(``master_listen_fd``). torch is imported on first use.
"""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import Any

__all__ = ["listening_socket", "host_store"]


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket listening on ``host:port`` only (``SO_REUSEADDR``, as the node's reservation of
    the port has: the two share it)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(socket.SOMAXCONN)
    except BaseException:
        sock.close()
        raise
    return sock


def host_store(host: str, port: int, world_size: int, timeout: timedelta) -> Any:
    """A ``TCPStore`` server for ``world_size`` ranks listening on ``host:port`` only."""
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    sock = listening_socket(host, port)
    return TCPStore(
        host,
        port,
        world_size,
        True,
        timeout=timeout,
        wait_for_workers=False,
        master_listen_fd=sock.detach(),  # torch owns the descriptor from here on
    )
