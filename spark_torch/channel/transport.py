"""Reliable delivery over authenticated links (:mod:`spark_torch.channel.wire`): reconnects, acks, heartbeats.

Node -> driver messages are numbered per node and kept until the driver acknowledges them;
after a reconnect they are resent and the driver drops repeats, so nothing is lost or doubled.
Driver -> node messages are state (a rendezvous decision, a stop), which the driver replays to a
node every time it (re)attaches. A node sends a heartbeat whenever it has been quiet for
``heartbeat`` seconds and the driver answers it; either end gives a connection up after
``DEAD_AFTER`` heartbeats of silence, so an idle drop by a firewall, NAT or cloud load
balancer is noticed within seconds and the node reconnects (TCP keepalive is the backstop).

The driver side bounds what strangers can cost: no thread for a connection that has not
proved the secret (one thread runs every handshake), a deadline on the whole handshake, at most
``MAX_PENDING_HANDSHAKES`` unauthenticated connections at once from strangers and
``MAX_PENDING_PER_ADDRESS`` from one of them, ``MAX_PENDING_PER_TRUSTED_ADDRESS`` more for each
executor address the driver knew from Spark, which strangers cannot take; when full, a random
handshake older than ``MIN_HANDSHAKE_AGE`` is closed, else the newcomer is refused
(:mod:`spark_torch.channel.handshake_slots`), so no flood pushes out a node that answers within
that time; a listen backlog of ``socket.SOMAXCONN``; warnings about strangers rate-limited
(:class:`RateLimitedLog`), one connection per node, and no thread survives its close.

This module holds the protocol's bounds and the listener; the two ends are
:mod:`spark_torch.channel.server` (driver) and :mod:`spark_torch.channel.client` (node).
"""

from __future__ import annotations

import errno
import logging
import random
import socket
import threading
import time

__all__ = [
    "bind_listener",
    "PortsUnavailable",
    "HANDSHAKE_SECONDS",
    "DEAD_AFTER",
    "MAX_PENDING_HANDSHAKES",
    "MAX_PENDING_PER_ADDRESS",
    "MAX_PENDING_PER_TRUSTED_ADDRESS",
    "MIN_HANDSHAKE_AGE",
    "LOG_INTERVAL",
    "RateLimitedLog",
    "WINDOW",
    "JOIN_SECONDS",
]

logger = logging.getLogger(__name__)

HANDSHAKE_SECONDS = 5.0
#: a connection silent for this many heartbeats is given up (and re-established by the node)
DEAD_AFTER = 4
#: a pending handshake costs one socket and no thread: room for many strangers' (an executor the
#: driver did not know when the run started is one of them), shared by every untrusted address
MAX_PENDING_HANDSHAKES = 128
#: one untrusted address cannot take more of them than this
MAX_PENDING_PER_ADDRESS = 32
#: each trusted address (an executor host known from Spark) has this many slots of its own, so
#: that many nodes on one host connecting at once do not push each other out
MAX_PENDING_PER_TRUSTED_ADDRESS = 128
#: a pending handshake younger than this is never closed to make room (a newcomer is refused)
MIN_HANDSHAKE_AGE = 1.0
#: a rate-limited kind of log line is written at most once per this many seconds
LOG_INTERVAL = 10.0
#: frames sent but not yet acknowledged before the node waits for the driver
WINDOW = 64
#: reconnect backoff bounds (seconds)
BACKOFF_MIN, BACKOFF_MAX = 0.05, 2.0
#: the backoff bound while the driver answers but closes the handshake (its handshake slots are
#: full of a flood's: a node's chance is per attempt, so it tries again soon)
BUSY_BACKOFF_MAX = 0.25
#: how long close() waits for each of its threads
JOIN_SECONDS = 5.0


class PortsUnavailable(OSError):
    """No port of the configured range could be bound."""


def bind_listener(host: str, ports: tuple[int, int] | None) -> socket.socket:
    """A listening TCP socket on ``host`` (name or address; IPv6 without brackets), on an
    OS-chosen port or the first free port of ``ports`` (inclusive, tried from a random start)."""
    infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    family, _, _, _, address = infos[0]
    candidates = [0] if ports is None else list(range(ports[0], ports[1] + 1))
    if len(candidates) > 1:
        start = random.randrange(len(candidates))
        candidates = candidates[start:] + candidates[:start]
    last: OSError | None = None
    for port in candidates:
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.bind((address[0], port, *address[2:]))
            sock.listen(socket.SOMAXCONN)  # the kernel caps it (net.core.somaxconn)
            return sock
        except OSError as exc:
            sock.close()
            if exc.errno not in (errno.EADDRINUSE, errno.EACCES):
                raise
            last = exc
    assert ports is not None
    raise PortsUnavailable(f"no free port in {ports[0]}-{ports[1]} on {host} ({last})")


class RateLimitedLog:
    """At most one line per ``interval`` seconds for one kind of event; a line says how many
    were suppressed since the last one (a flood of strangers must not flood the driver's log)."""

    def __init__(self, log: logging.Logger, level: int, interval: float = LOG_INTERVAL) -> None:
        self._log = log
        self._level = level
        self._interval = interval
        self._lock = threading.Lock()
        self._last = -float("inf")
        self._suppressed = 0

    def __call__(self, message: str, *args: object) -> None:
        """Log ``message % args`` unless a line was logged less than ``interval`` ago."""
        now = time.monotonic()
        with self._lock:
            if now - self._last < self._interval:
                self._suppressed += 1
                return
            suppressed, self._suppressed, self._last = self._suppressed, 0, now
        if suppressed:
            message += f" (and {suppressed} more like it in the last {self._interval:g}s)"
        self._log.log(self._level, message, *args)

    def flush(self, what: str) -> None:
        """Log the count of suppressed lines, if any (e.g. when the server closes)."""
        with self._lock:
            suppressed, self._suppressed = self._suppressed, 0
        if suppressed:
            self._log.log(self._level, "%s: %d more not logged (rate limit)", what, suppressed)
