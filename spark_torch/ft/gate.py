"""The gates in front of the run's torchft lighthouse (:class:`AddressGate`).

torchft's lighthouse authenticates nobody: a participant can claim the highest step and make the
ranks heal from it (and torchft's ``PGTransport`` unpickles what a heal source sends), and its
dashboard can end a replica's process (``POST /replica/:id/kill``). The lighthouse listens where no
one else can reach it (:mod:`spark_torch.ft.hideout`); a gate is its way in, in one of two kinds.

Without ``secret`` (local mode's ranks, and the driver's own look at the lighthouse): a
connection made on the driver's machine (over loopback or any of its addresses) is let through
only when it is this user's: its client socket's owner in the kernel's table
(:func:`~spark_torch.ft.peers.local_peer_uid`), so that another user of the machine is closed
out. A connection from another machine is let through when it comes from one of the cluster's
addresses (the executors Spark lists; an address it does not know makes it ask again, at most
once a second: an executor added since the run began gets in), or from any address when the
driver cannot list them (``allowed`` None: Spark Connect). An address is not an authentication.

With ``secret`` (distributed mode: where the nodes' relays, :mod:`spark_torch.ft.node_relay`,
connect): every connection must first prove the run's secret with the channel's handshake, run
by the gate's one thread (:class:`~spark_torch.ft.relay.Relay`), whatever user or machine it comes
from; one from another machine must also come from a cluster's address (as above) to be heard at
all. A connection that does not prove the secret within the handshake's deadline is closed
before a byte of it reaches the lighthouse.

Any connection refused is closed at once, and logged once per address and reason. The admitted
connections are passed through byte for byte by one thread (:class:`~spark_torch.ft.relay.Relay`).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import time
from collections.abc import Callable

from spark_torch.ft.peers import local_peer_uid
from spark_torch.ft.relay import Relay

__all__ = ["AddressGate", "REFRESH_SECONDS"]

logger = logging.getLogger(__name__)

#: an unknown address asks for the cluster's addresses again at most this often
REFRESH_SECONDS = 1.0
#: how long connecting to the lighthouse behind the gate (on loopback) may take
BACKEND_CONNECT_SECONDS = 5.0
#: strangers' addresses logged (once each); a scan of many addresses logs no more than these
MAX_LOGGED_STRANGERS = 256


def _plain(address: str) -> str:
    """An IPv4 address mapped into IPv6 (``::ffff:10.0.0.5``) as IPv4; others as they are."""
    try:
        parsed = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return address
    mapped = getattr(parsed, "ipv4_mapped", None)
    return str(mapped) if mapped is not None else str(parsed)


class AddressGate:
    """Listens on ``host`` (a free port: :attr:`port`) and passes the connections it admits (see
    the module's docstring) to ``backend``: a Unix socket's path, or ``(host, port)``. ``allowed``
    lists the cluster's addresses (None: every address of another machine is admitted); ``clock``
    times the asks for them; ``peer_uid`` finds a connection's user on this machine (None: made
    on another machine); ``secret``: every connection must prove it (see the module's docstring).
    Stopped by :meth:`close` (idempotent): nothing listens or runs after it."""

    def __init__(
        self,
        host: str,
        backend: str | tuple[str, int],
        allowed: Callable[[], set[str]] | None,
        clock: Callable[[], float] = time.monotonic,
        peer_uid: Callable[[socket.socket], int | None] = local_peer_uid,
        secret: bytes | None = None,
    ) -> None:
        self.backend = backend
        self._peer_uid = peer_uid
        self._allowed_of = allowed
        self._clock = clock
        self._allowed = {_plain(a) for a in allowed()} if allowed is not None else set()
        self._asked = clock()
        self._refused: set[str] = set()
        self._uid = os.geteuid()
        info = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
        listener = socket.socket(info[0], socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(info[4])
            listener.listen(socket.SOMAXCONN)
        except BaseException:
            listener.close()
            raise
        self.port: int = listener.getsockname()[1]
        self._secret = secret
        self._relay = Relay(
            listener,
            self._connect,
            self._admits_connection,
            name="spark-torch-lighthouse-gate",
            secret=secret,
            trusted=self._allowed,
            refused=self._log_refused,
        )

    def admits(self, address: str) -> bool:
        """Whether a connection from ``address`` of another machine is passed through (asks for
        the cluster's addresses again when it is unknown and the last ask is over
        :data:`REFRESH_SECONDS` old)."""
        if self._allowed_of is None:
            return True
        address = _plain(address)
        if address in self._allowed:
            return True
        if self._clock() - self._asked >= REFRESH_SECONDS:
            self._asked = self._clock()
            try:
                self._allowed = {_plain(a) for a in self._allowed_of()}
            except Exception as exc:  # noqa: BLE001 - keep the addresses known so far
                logger.debug("spark_torch: could not list the cluster's addresses again: %s", exc)
        return address in self._allowed

    def _admits_connection(self, conn: socket.socket, peer: tuple[str, int]) -> bool:
        uid = self._peer_uid(conn)
        if uid is not None and self._secret is not None:
            return True  # the handshake decides
        if uid is not None:
            admitted = uid == self._uid
            why = (
                f"user id {uid} of this machine, not this run's ({self._uid}: ranks on this machine run as the "
                "driver's user)"
            )
        else:
            admitted = self.admits(peer[0])
            why = "not one of the cluster's addresses"
        if not admitted:
            self._log_refused(str(peer[0]), why, f"{peer[0]} {uid}")
        return admitted

    def _log_refused(self, host: str, why: str, key: str | None = None) -> None:
        """One WARNING per address and reason (at most :data:`MAX_LOGGED_STRANGERS` in all)."""
        key = key or f"{host} {why.split(' (', 1)[0]}"
        if key not in self._refused and len(self._refused) < MAX_LOGGED_STRANGERS:
            self._refused.add(key)
            logger.warning("spark_torch: refused a connection to the run's torchft lighthouse from %s: %s", host, why)

    def _connect(self) -> socket.socket:
        if isinstance(self.backend, str):
            upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                upstream.settimeout(BACKEND_CONNECT_SECONDS)
                upstream.connect(self.backend)
            except BaseException:
                upstream.close()
                raise
            return upstream
        return socket.create_connection(self.backend, timeout=BACKEND_CONNECT_SECONDS)

    @property
    def pipes(self) -> int:
        """How many connections are passed through now."""
        return self._relay.pipes

    def close(self) -> None:
        """Stop listening and end every connection (idempotent)."""
        self._relay.close()
