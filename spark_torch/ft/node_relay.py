"""A node's way to the run's torchft lighthouse (:class:`NodeRelay`), in distributed mode.

torchft's lighthouse authenticates nobody, so its ranks do not reach the driver's gate
themselves: each node listens on its own loopback, where only processes of its machine can
connect, and lets through only this user's connections (the owner of the client socket in the
kernel's table, :func:`~spark_torch.ft.peers.local_peer_uid`: another user of the executor's
machine is closed before a byte is read). Each admitted connection is passed on over a new
connection to the driver's gate that proves the run's lighthouse secret both ways, with the
channel's handshake (:func:`~spark_torch.channel.wire.client_handshake`; the driver's side,
:class:`~spark_torch.ft.gate.AddressGate` with ``secret``, refuses every connection that does not
prove it). The ranks' ``TORCHFT_LIGHTHOUSE`` is this relay's address (:attr:`NodeRelay.address`).

One thread passes every connection through and one more makes the connections to the driver,
one after the other, each within :data:`DIAL_SECONDS` (:class:`~spark_torch.ft.relay.Relay`).
After the handshake the bytes travel as torchft sends them (gRPC in clear), as gloo's do: the
handshake keeps out whoever does not know the secret, not an eavesdropper on the path.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Mapping
from urllib.parse import urlparse

from spark_torch.base.envnames import TORCHFT_LIGHTHOUSE
from spark_torch.channel.wire import client_handshake
from spark_torch.ft.peers import local_peer_uid
from spark_torch.ft.relay import Relay
from spark_torch.ft.wiring import bind_address

__all__ = ["NodeRelay", "DIAL_SECONDS", "LOOPBACK", "gate_of", "start_for"]

logger = logging.getLogger(__name__)

#: how long a connection to the driver's gate, its handshake included, may take
DIAL_SECONDS = 10.0
#: where the relay listens: only this machine's processes reach it
LOOPBACK = "127.0.0.1"


def gate_of(address: str) -> tuple[str, int]:
    """``(host, port)`` of a lighthouse address (``http://HOST:PORT``, IPv6 in brackets)."""
    url = urlparse(address)
    if not url.hostname or url.port is None:
        raise ValueError(f"not a lighthouse address (http://HOST:PORT): {address!r}")
    return url.hostname, url.port


class NodeRelay:
    """Listens on :data:`LOOPBACK` (a free port) and passes this user's connections on to the
    driver's gate at ``gate`` over connections that prove ``secret`` (see the module's
    docstring). Stopped by :meth:`close` (idempotent): nothing listens or runs after it."""

    def __init__(self, gate: tuple[str, int], secret: bytes, dial_seconds: float = DIAL_SECONDS) -> None:
        if not secret:
            raise ValueError("a node's relay needs the run's lighthouse secret")
        self.gate = gate
        self._secret = secret
        self._dial_seconds = dial_seconds
        self._uid = os.geteuid()
        self._lock = threading.Lock()
        self._said: set[str] = set()
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            listener.bind((LOOPBACK, 0))
            listener.listen(socket.SOMAXCONN)
        except BaseException:
            listener.close()
            raise
        self.port: int = listener.getsockname()[1]
        self._relay = Relay(
            listener,
            self._dial,
            self._admits,
            name="spark-torch-lighthouse-node-relay",
            dial=True,
            dial_seconds=dial_seconds,
        )

    @property
    def address(self) -> str:
        """What this node's ranks get as ``TORCHFT_LIGHTHOUSE``."""
        return f"http://{bind_address(LOOPBACK, self.port)}"

    def variables(self) -> dict[str, str]:
        """What the node's ranks get instead of the driver's gate."""
        return {TORCHFT_LIGHTHOUSE: self.address}

    @property
    def pipes(self) -> int:
        """How many connections are passed through now."""
        return self._relay.pipes

    def _admits(self, conn: socket.socket, peer: tuple[str, int]) -> bool:
        uid = local_peer_uid(conn)
        if uid == self._uid:
            return True
        self._say(
            f"user {uid}",
            "spark_torch: the node's relay to the run's torchft lighthouse refused a connection from %s of user id "
            "%s: only this run's user (%d) may use it",
            peer[0],
            uid,
            self._uid,
        )
        return False

    def _dial(self) -> socket.socket:
        """A connection to the driver's gate that proved the secret both ways (the dialer's thread)."""
        deadline = time.monotonic() + self._dial_seconds
        host, port = self.gate
        sock: socket.socket | None = None
        try:
            sock = socket.create_connection((host, port), timeout=self._dial_seconds)
            client_handshake(sock, self._secret, deadline, None)
        except (OSError, ValueError) as exc:
            if sock is not None:
                sock.close()
            self._say(
                type(exc).__name__,
                "spark_torch: the node's relay could not reach the run's torchft lighthouse through the driver's gate "
                "at %s within %g s (%s): the executors must reach the driver's address (spark.driver.host, "
                "SPARK_TORCH_CHANNEL_HOST) and the driver must be this run's",
                bind_address(host, port),
                self._dial_seconds,
                exc,
            )
            raise
        sock.settimeout(None)
        return sock

    def _say(self, key: str, message: str, *args: object) -> None:
        """A WARNING once per kind of problem."""
        with self._lock:
            if key in self._said:
                return
            self._said.add(key)
        logger.warning(message, *args)

    def close(self) -> None:
        """Stop listening and end every connection (idempotent)."""
        self._relay.close()


def start_for(extra_env: Mapping[str, str], secret: bytes) -> NodeRelay | None:
    """The node's relay for a run whose ranks get ``extra_env`` (a replica group's: its
    ``TORCHFT_LIGHTHOUSE`` is the driver's gate) and whose lighthouse secret is ``secret``; None
    when the run has no such gate (local mode, no replica groups)."""
    gate = extra_env.get(TORCHFT_LIGHTHOUSE)
    if not secret or not gate:
        return None
    return NodeRelay(gate_of(gate), secret)
