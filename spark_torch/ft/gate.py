"""An address gate in front of the run's torchft lighthouse (:class:`AddressGate`).

torchft's lighthouse authenticates nobody, and its dashboard can end a replica's process
(``POST /replica/:id/kill``). In distributed mode the driver runs it on loopback only and puts this
gate on the address the executors reach: a connection from one of the cluster's addresses (the
executors Spark lists, the driver's own) is passed through to the lighthouse, byte for byte; any
other is closed at once, before a byte of it reaches the lighthouse. An address it does not know
makes it ask for the cluster's addresses again (at most once a second): an executor added since
the run began (a lost one replaced) gets in. An address is not an authentication: anyone who can
send from an executor's address still reaches the lighthouse (docs/security.md).
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
import time
from collections.abc import Callable

__all__ = ["AddressGate", "REFRESH_SECONDS"]

logger = logging.getLogger(__name__)

#: an unknown address asks for the cluster's addresses again at most this often
REFRESH_SECONDS = 1.0
#: how long connecting to the lighthouse behind the gate (on loopback) may take
BACKEND_CONNECT_SECONDS = 5.0
#: how long close() waits for the gate's threads
CLOSE_WAIT_SECONDS = 5.0
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
    """Listens on ``host`` (a free port: :attr:`port`) and passes the connections of the
    addresses ``allowed()`` returns to ``backend`` (``(host, port)``); closes the others at once.
    ``clock`` times the asks for the addresses. Stopped by :meth:`close` (idempotent): nothing
    listens or runs after it."""

    def __init__(
        self, host: str, backend: tuple[str, int], allowed: Callable[[], set[str]], clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.backend = backend
        self._allowed_of = allowed
        self._clock = clock
        self._allowed = {_plain(a) for a in allowed()}
        self._asked = clock()
        self._refused: set[str] = set()
        info = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
        self._listener = socket.socket(info[0], socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(info[4])
        self._listener.listen(64)
        self._listener.settimeout(0.2)  # the accept loop looks at _closed this often
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._closed = False
        self._open: set[socket.socket] = set()
        #: per socket of a pair, whether its reading pump has finished
        self._finished: dict[socket.socket, bool] = {}
        self._threads: list[threading.Thread] = []
        self._accepting = threading.Thread(target=self._accept_loop, name="spark-torch-lighthouse-gate", daemon=True)
        self._accepting.start()

    def admits(self, address: str) -> bool:
        """Whether a connection from ``address`` is passed through (asks for the cluster's
        addresses again when it is unknown and the last ask is over :data:`REFRESH_SECONDS` old)."""
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

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, peer = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:  # closed
                return
            if not self.admits(peer[0]):
                conn.close()
                if peer[0] not in self._refused and len(self._refused) < MAX_LOGGED_STRANGERS:
                    self._refused.add(peer[0])
                    logger.warning(
                        "spark_torch: refused a connection to the run's torchft lighthouse from %s, which is not "
                        "one of the cluster's addresses", peer[0],
                    )  # fmt: skip
                continue
            self._pass_through(conn)

    def _pass_through(self, conn: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self.backend, timeout=BACKEND_CONNECT_SECONDS)
        except OSError as exc:
            logger.debug("spark_torch: the torchft lighthouse behind the gate did not answer: %s", exc)
            conn.close()
            return
        for end in (conn, upstream):
            end.settimeout(None)
            # relay each piece as it comes: gRPC's small frames would otherwise wait for the
            # peer's delayed acknowledgement (Nagle's algorithm: ~40 ms a call, measured)
            end.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._lock:
            if self._closed:
                conn.close()
                upstream.close()
                return
            self._open |= {conn, upstream}
            self._threads = [thread for thread in self._threads if thread.is_alive()]  # ended connections' pumps
            for source, target in ((conn, upstream), (upstream, conn)):
                pump = threading.Thread(target=self._pump, args=(source, target), name="spark-torch-lighthouse-pipe", daemon=True)
                self._threads.append(pump)
                pump.start()

    def _pump(self, source: socket.socket, target: socket.socket) -> None:
        """Copy ``source`` to ``target``; at ``source``'s end pass the end on (a half-close: the
        other way may still carry an answer), on an error end both ways. The second of a pair's
        two pumps to finish closes both sockets."""
        try:
            while data := source.recv(65536):
                target.sendall(data)
            how = socket.SHUT_WR
        except OSError:
            how = socket.SHUT_RDWR
        for end, side in ((target, how), (source, socket.SHUT_RD if how == socket.SHUT_WR else how)):
            try:
                end.shutdown(side)
            except OSError:
                pass
        with self._lock:
            self._finished[source] = True
            if self._finished.get(target):
                for end in (source, target):
                    self._finished.pop(end, None)
                    self._open.discard(end)
                    end.close()

    def close(self) -> None:
        """Stop listening and end every connection (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            ends, threads = list(self._open), list(self._threads)
        self._listener.close()
        for end in ends:
            try:
                end.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        deadline = time.monotonic() + CLOSE_WAIT_SECONDS
        for thread in [self._accepting, *threads]:
            thread.join(max(0.0, deadline - time.monotonic()))
