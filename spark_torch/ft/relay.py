"""Byte pipes from admitted connections to a backend, all in one thread (:class:`Relay`).

The lighthouse's gate (:mod:`spark_torch.ft.gate`), its hideout (:mod:`spark_torch.ft.hideout`)
and each node's relay to it (:mod:`spark_torch.ft.node_relay`) pass connections through, byte for
byte, to a server behind them. One thread and a selector serve every pipe: an idle connection
costs its sockets and two small buffers, no thread (300 idle connections used to cost 600
threads), and the listener's backlog is the system's (``socket.SOMAXCONN``). ``admit`` decides on
each connection before a byte of it is read or passed on; a refused one is closed at once.

Two options, for the path from a node to the driver's gate:

- ``secret``: an admitted connection is passed on only once it proved the run's secret with the
  channel's handshake (:class:`~spark_torch.channel.wire.ServerChallenge`, run by the same thread
  and selector: a peer that has not proved it costs a socket, never a thread); one that fails it,
  or has not finished it within :data:`HANDSHAKE_SECONDS`, is closed before a byte of it reaches
  the backend. Pending handshakes are bounded per address as the channel's are
  (:class:`~spark_torch.channel.handshake_slots.HandshakeSlots`).
- ``dial``: ``connect()`` may block (a connection to another machine and a handshake): it runs
  in one more thread, one connection after the other, and the pipes go on meanwhile.
"""

from __future__ import annotations

import collections
import logging
import queue
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from spark_torch.channel.handshake_slots import HandshakeSlots
from spark_torch.channel.transport import (
    MAX_PENDING_HANDSHAKES,
    MAX_PENDING_PER_ADDRESS,
    MAX_PENDING_PER_TRUSTED_ADDRESS,
    MIN_HANDSHAKE_AGE,
)

if TYPE_CHECKING:  # the handshake's module needs cryptography: imported when a secret is used
    from spark_torch.channel.wire import ServerChallenge

__all__ = ["Relay", "BUFFER", "CLOSE_WAIT_SECONDS", "HANDSHAKE_SECONDS", "MAX_DIALS"]

logger = logging.getLogger(__name__)

#: bytes read at once, and held for a slow reader before its writer is no longer read
BUFFER = 65536
#: how long close() waits for the relay's thread (and its dialer's, after its dial's own deadline)
CLOSE_WAIT_SECONDS = 5.0
#: how long a peer has to prove the run's secret (``secret``)
HANDSHAKE_SECONDS = 10.0
#: connections waiting for their dial (``dial``); more are closed
MAX_DIALS = 256


class _End:
    """One socket of a pipe: what waits to be written to it, and whether its reading side ended."""

    def __init__(self, sock: socket.socket, pending: bytes = b"") -> None:
        self.sock = sock
        self.pending = bytearray(pending)
        self.read_done = False
        self.write_done = False
        self.other: _End = self


@dataclass(eq=False)
class _Greeting:
    """A connection in the handshake: what is left to send it, and its answer so far."""

    sock: socket.socket
    host: str
    deadline: float
    challenge: ServerChallenge
    out: bytearray
    answer: bytearray = field(default_factory=bytearray)


class Relay:
    """Accepts on ``listener`` (bound and listening), asks ``admit(conn, peer)`` about each
    connection and pipes each admitted one to a new connection from ``connect()``; a refused
    connection, or one whose backend cannot be reached, is closed. With ``secret``, an admitted
    connection must first prove it (``trusted``: the addresses whose pending handshakes have
    slots of their own; ``refused(host, why)`` hears of each that did not); with ``dial``,
    ``connect()`` runs in a thread of its own (see the module's docstring). :meth:`close`
    (idempotent) stops listening, ends every pipe and the threads."""

    def __init__(
        self,
        listener: socket.socket,
        connect: Callable[[], socket.socket],
        admit: Callable[[socket.socket, Any], bool],
        name: str = "spark-torch-relay",
        *,
        secret: bytes | None = None,
        trusted: Iterable[str] = (),
        refused: Callable[[str, str], None] | None = None,
        dial: bool = False,
        dial_seconds: float = 0.0,
    ) -> None:
        self._listener = listener
        self._connect = connect
        self._admit = admit
        self._secret = secret
        self._refused = refused or (lambda host, why: None)
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        listener.setblocking(False)
        self._selector.register(listener, selectors.EVENT_READ, "accept")
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._ends: set[_End] = set()
        #: pending handshakes in arrival (= deadline) order
        self._greetings: collections.OrderedDict[socket.socket, _Greeting] = collections.OrderedDict()
        self._slots: HandshakeSlots[socket.socket] = HandshakeSlots(
            trusted,
            total=MAX_PENDING_HANDSHAKES,
            per_address=MAX_PENDING_PER_ADDRESS,
            trusted_per_address=MAX_PENDING_PER_TRUSTED_ADDRESS,
            min_age=MIN_HANDSHAKE_AGE,
        )
        self._closed = False
        self._dial_seconds = dial_seconds
        #: connections waiting for their dial, and the dials done (the dialer's thread appends)
        self._to_dial: queue.Queue[socket.socket | None] = queue.Queue()
        self._waiting: set[socket.socket] = set()
        self._dialed: collections.deque[tuple[socket.socket, socket.socket | None]] = collections.deque()
        self._dialer = threading.Thread(target=self._dial_loop, name=f"{name}-dialer", daemon=True) if dial else None
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()
        if self._dialer is not None:
            self._dialer.start()

    @property
    def pipes(self) -> int:
        """How many connections are being passed through now."""
        return len(self._ends) // 2

    @property
    def handshakes(self) -> int:
        """How many connections are in the handshake now."""
        return len(self._greetings)

    def close(self) -> None:
        """Stop listening and end every pipe (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._wake()
        if self._dialer is not None:
            self._to_dial.put(None)
            if threading.current_thread() is not self._dialer:
                self._dialer.join(self._dial_seconds + CLOSE_WAIT_SECONDS)
        if threading.current_thread() is not self._thread:
            self._thread.join(CLOSE_WAIT_SECONDS)

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    def _loop(self) -> None:
        try:
            while not self._closed:
                for key, events in self._selector.select(timeout=self._timeout()):
                    if key.data == "accept":
                        self._accept()
                    elif key.data == "wake":
                        self._woken()
                    elif isinstance(key.data, _End):
                        self._serve(key.data, events)
                    elif isinstance(key.data, _Greeting):
                        self._greet(key.data, events)
                self._expire()
        except Exception:  # noqa: BLE001 - a bug here must not leave sockets open
            logger.exception("spark_torch: the relay %s stopped", threading.current_thread().name)
        finally:
            for end in list(self._ends):
                self._drop(end)
            for greeting in list(self._greetings.values()):
                self._forget(greeting)
            while self._dialed:
                for each in self._dialed.popleft():
                    if each is not None:
                        each.close()
            for sock in (*self._waiting, self._listener, self._wake_r, self._wake_w):
                sock.close()
            self._waiting.clear()
            self._selector.close()

    def _timeout(self) -> float:
        """Until the oldest handshake's deadline, at most a second."""
        if not self._greetings:
            return 1.0
        first = next(iter(self._greetings.values()))
        return min(1.0, max(0.0, first.deadline - time.monotonic()))

    def _accept(self) -> None:
        while True:
            try:
                conn, peer = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # e.g. out of file descriptors: try again at the next event
                logger.debug("spark_torch: the relay could not accept: %s", exc)
                return
            try:
                admitted = self._admit(conn, peer)
            except Exception as exc:  # noqa: BLE001 - a failed check refuses
                logger.debug("spark_torch: the relay's check failed, refused: %s", exc)
                admitted = False
            if not admitted:
                conn.close()
            elif self._secret is not None:
                self._challenge(conn, peer)
            else:
                self._upstream(conn)

    def _upstream(self, conn: socket.socket, pending: bytes = b"") -> None:
        """Connect ``conn`` (admitted, proven) to the backend: at once, or through the dialer."""
        if self._dialer is not None:
            if len(self._waiting) >= MAX_DIALS:
                logger.debug("spark_torch: %d connections wait for the relay's dialer: one more closed", MAX_DIALS)
                conn.close()
                return
            self._waiting.add(conn)
            self._to_dial.put(conn)
            return
        try:
            upstream = self._connect()
        except OSError as exc:
            logger.debug("spark_torch: the server behind the relay did not answer: %s", exc)
            conn.close()
            return
        self._pair(conn, upstream, pending)

    def _dial_loop(self) -> None:
        """The dialer's thread: ``connect()`` for each waiting connection, one after the other."""
        while True:
            conn = self._to_dial.get()
            if conn is None or self._closed:
                return
            upstream: socket.socket | None
            try:
                upstream = self._connect()
            except Exception as exc:  # noqa: BLE001 - the connection is closed; connect() said why
                logger.debug("spark_torch: the relay's dial failed: %s", exc)
                upstream = None
            self._dialed.append((conn, upstream))
            self._wake()

    def _woken(self) -> None:
        try:
            self._wake_r.recv(4096)
        except (BlockingIOError, InterruptedError):
            pass
        while self._dialed:
            conn, upstream = self._dialed.popleft()
            self._waiting.discard(conn)
            if upstream is None or self._closed:
                conn.close()
                if upstream is not None:
                    upstream.close()
            else:
                self._pair(conn, upstream)

    def _challenge(self, conn: socket.socket, peer: Any) -> None:
        """Start the handshake of an admitted connection (when its address has room for one)."""
        host = str(peer[0]) if isinstance(peer, tuple) and peer else str(peer)
        admission = self._slots.admit(conn, host, time.monotonic())
        evicted = self._greetings.get(admission.evict) if admission.evict is not None else None
        if evicted is not None:  # the slots forgot it already
            self._refused(evicted.host, "its handshake was closed to make room for a newer one")
            self._forget(evicted, slots=False)
        if not admission.admitted:
            self._refused(host, "too many connections from it are in the handshake")
            conn.close()
            return
        conn.setblocking(False)
        from spark_torch.channel.wire import ServerChallenge

        challenge = ServerChallenge(self._secret or b"")
        greeting = _Greeting(conn, host, time.monotonic() + HANDSHAKE_SECONDS, challenge, bytearray(challenge.greeting))
        self._greetings[conn] = greeting
        self._selector.register(conn, selectors.EVENT_READ | selectors.EVENT_WRITE, greeting)

    def _greet(self, greeting: _Greeting, events: int) -> None:
        """One step of a handshake: send what is left of the greeting, read the answer, check it."""
        from spark_torch.channel.wire import ANSWER_BYTES, AuthenticationError

        try:
            if events & selectors.EVENT_WRITE and greeting.out:
                del greeting.out[: greeting.sock.send(greeting.out)]
            if events & selectors.EVENT_READ:
                data = greeting.sock.recv(ANSWER_BYTES - len(greeting.answer))  # not a byte past the answer
                if not data:
                    raise ConnectionError("it closed the connection during the handshake")
                greeting.answer += data
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._refused(greeting.host, f"the handshake failed ({exc})")
            self._forget(greeting)
            return
        if len(greeting.answer) < ANSWER_BYTES:
            self._selector.modify(
                greeting.sock, selectors.EVENT_READ | (selectors.EVENT_WRITE if greeting.out else 0), greeting
            )
            return
        try:
            proof, _ = greeting.challenge.check(bytes(greeting.answer))
        except AuthenticationError as exc:
            self._refused(greeting.host, str(exc))
            self._forget(greeting)
            return
        self._forget(greeting, close=False)
        self._upstream(greeting.sock, bytes(greeting.out) + proof)

    def _expire(self) -> None:
        """Close the handshakes past their deadline."""
        now = time.monotonic()
        while self._greetings:
            greeting = next(iter(self._greetings.values()))
            if greeting.deadline > now:
                return
            self._refused(greeting.host, f"it did not prove the run's secret within {HANDSHAKE_SECONDS:g} s")
            self._forget(greeting)

    def _forget(self, greeting: _Greeting, close: bool = True, slots: bool = True) -> None:
        """A handshake ended: out of the slots (``slots``), the selector and (``close``) closed
        (a refusal is logged before: a peer that saw its connection closed finds it logged)."""
        if self._greetings.pop(greeting.sock, None) is None:
            return
        if slots:
            self._slots.remove(greeting.sock)
        self._selector.unregister(greeting.sock)
        if close:
            greeting.sock.close()

    def _pair(self, conn: socket.socket, upstream: socket.socket, pending: bytes = b"") -> None:
        """Pipe ``conn`` and ``upstream``; ``pending``: what ``conn`` is still to be sent first."""
        a, b = _End(conn, pending), _End(upstream)
        a.other, b.other = b, a
        for end in (a, b):
            end.sock.setblocking(False)
            if end.sock.family in (socket.AF_INET, socket.AF_INET6):
                # pass each piece on as it comes: gRPC's small frames would otherwise wait for the
                # peer's delayed acknowledgement (Nagle's algorithm: ~40 ms a call, measured)
                end.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._ends.add(end)
            self._selector.register(end.sock, self._events(end), end)

    def _events(self, end: _End) -> int:
        """What to wait for on ``end``: reading while its peer's buffer has room, writing while
        its own buffer holds bytes."""
        wanted = 0
        if not end.read_done and len(end.other.pending) < BUFFER:
            wanted |= selectors.EVENT_READ
        if end.pending:
            wanted |= selectors.EVENT_WRITE
        return wanted

    def _update(self, end: _End) -> None:
        if end not in self._ends:
            return
        wanted = self._events(end)
        registered = end.sock in self._selector.get_map()
        if wanted and registered:
            self._selector.modify(end.sock, wanted, end)
        elif wanted:
            self._selector.register(end.sock, wanted, end)
        elif registered:
            self._selector.unregister(end.sock)

    def _serve(self, end: _End, events: int) -> None:
        other = end.other
        try:
            if events & selectors.EVENT_READ:
                data = end.sock.recv(BUFFER)
                if data:
                    other.pending += data
                else:
                    end.read_done = True
            if events & selectors.EVENT_WRITE and end.pending:
                sent = end.sock.send(end.pending)
                del end.pending[:sent]
            for side in (end, other):
                # a reader that ended, once what it sent is passed on: the end goes on to the other side
                if side.read_done and not side.other.pending and not side.other.write_done:
                    side.other.write_done = True
                    side.other.sock.shutdown(socket.SHUT_WR)
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self._drop(end)
            return
        if end.read_done and other.read_done and not end.pending and not other.pending:
            self._drop(end)
            return
        self._update(end)
        self._update(other)

    def _drop(self, end: _End) -> None:
        """End a pipe: both its sockets closed."""
        for side in (end, end.other):
            if side in self._ends:
                self._ends.discard(side)
                if side.sock in self._selector.get_map():
                    self._selector.unregister(side.sock)
                side.sock.close()
