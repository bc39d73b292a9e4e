"""Byte pipes from admitted connections to a backend, all in one thread (:class:`Relay`).

The lighthouse's gate (:mod:`spark_torch.ft.gate`) and its hideout (:mod:`spark_torch.ft.hideout`)
both pass connections through, byte for byte, to a server behind them. One thread and a selector
serve every pipe: an idle connection costs its sockets and two small buffers, no thread (300 idle
connections used to cost 600 threads), and the listener's backlog is the system's
(``socket.SOMAXCONN``). ``admit`` decides on each connection before a byte of it is read or
passed on; a refused one is closed at once.
"""

from __future__ import annotations

import logging
import selectors
import socket
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["Relay", "BUFFER", "CLOSE_WAIT_SECONDS"]

logger = logging.getLogger(__name__)

#: bytes read at once, and held for a slow reader before its writer is no longer read
BUFFER = 65536
#: how long close() waits for the relay's thread
CLOSE_WAIT_SECONDS = 5.0


class _End:
    """One socket of a pipe: what waits to be written to it, and whether its reading side ended."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.pending = bytearray()
        self.read_done = False
        self.write_done = False
        self.other: _End = self


class Relay:
    """Accepts on ``listener`` (bound and listening), asks ``admit(conn, peer)`` about each
    connection and pipes each admitted one to a new connection from ``connect()``; a refused
    connection, or one whose backend cannot be reached, is closed. :meth:`close` (idempotent)
    stops listening, ends every pipe and the thread."""

    def __init__(
        self,
        listener: socket.socket,
        connect: Callable[[], socket.socket],
        admit: Callable[[socket.socket, Any], bool],
        name: str = "spark-torch-relay",
    ) -> None:
        self._listener = listener
        self._connect = connect
        self._admit = admit
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        listener.setblocking(False)
        self._selector.register(listener, selectors.EVENT_READ, "accept")
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._ends: set[_End] = set()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    @property
    def pipes(self) -> int:
        """How many connections are being passed through now."""
        return len(self._ends) // 2

    def close(self) -> None:
        """Stop listening and end every pipe (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if threading.current_thread() is not self._thread:
            self._thread.join(CLOSE_WAIT_SECONDS)

    def _loop(self) -> None:
        try:
            while not self._closed:
                for key, events in self._selector.select(timeout=1.0):
                    if key.data == "accept":
                        self._accept()
                    elif isinstance(key.data, _End):
                        self._serve(key.data, events)
        except Exception:  # noqa: BLE001 - a bug here must not leave sockets open
            logger.exception("spark_torch: the relay %s stopped", threading.current_thread().name)
        finally:
            for end in list(self._ends):
                self._drop(end)
            for sock in (self._listener, self._wake_r, self._wake_w):
                sock.close()
            self._selector.close()

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
                continue
            try:
                upstream = self._connect()
            except OSError as exc:
                logger.debug("spark_torch: the server behind the relay did not answer: %s", exc)
                conn.close()
                continue
            self._pair(conn, upstream)

    def _pair(self, conn: socket.socket, upstream: socket.socket) -> None:
        a, b = _End(conn), _End(upstream)
        a.other, b.other = b, a
        for end in (a, b):
            end.sock.setblocking(False)
            if end.sock.family in (socket.AF_INET, socket.AF_INET6):
                # pass each piece on as it comes: gRPC's small frames would otherwise wait for the
                # peer's delayed acknowledgement (Nagle's algorithm: ~40 ms a call, measured)
                end.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._ends.add(end)
            self._selector.register(end.sock, selectors.EVENT_READ, end)

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
