"""The driver end of the reliable channel (:mod:`spark_torch.channel.transport`): accepts
authenticated node connections, hands their numbered messages on exactly once, acknowledges
them, answers heartbeats, and sends the driver's state to (re)attaching nodes.

One thread (``spark-torch-channel-accept``) accepts connections and runs every handshake with a
selector, so a peer that has not proved the run's secret costs a socket, never a thread; which
pending handshakes it keeps when they are at their bound (trusted executor addresses apart,
never one younger than a second) is :mod:`spark_torch.channel.handshake_slots`. A peer that
proved the secret and attached as a node gets a thread that reads its connection. Handler calls
for one node are serialized by a lock per node, across an old and a new connection of that node
(a reconnect), so they stay in order and never overlap. (One module, about 400 lines: the accept loop, the handshakes
and the connection threads share the server's state and bounds, and read best together.)
"""

from __future__ import annotations

import collections
import logging
import selectors
import socket
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from spark_torch.channel.handshake_slots import HandshakeSlots
from spark_torch.channel.transport import (
    DEAD_AFTER,
    HANDSHAKE_SECONDS,
    JOIN_SECONDS,
    MAX_PENDING_HANDSHAKES,
    MAX_PENDING_PER_ADDRESS,
    MAX_PENDING_PER_TRUSTED_ADDRESS,
    MIN_HANDSHAKE_AGE,
    RateLimitedLog,
    bind_listener,
)
from spark_torch.channel.wire import (
    ANSWER_BYTES,
    AuthenticationError,
    Link,
    ProtocolError,
    ServerChallenge,
    encode,
    tune_socket,
)

__all__ = ["ChannelServer", "ServerHandler"]

logger = logging.getLogger(__name__)

#: connections accepted per wake-up of the handshake thread (it then serves pending answers)
_ACCEPT_BURST = 32


class ServerHandler(Protocol):
    """What the driver side does with nodes and their messages (called from connection threads;
    calls for one node never overlap)."""

    def attached(self, node: int) -> list[dict[str, Any]]:
        """A node (re)connected; returns the messages to (re)send to it (current state)."""

    def message(self, node: int, message: dict[str, Any]) -> None:
        """A node's numbered message, exactly once; raise ValueError/TypeError/KeyError if it is
        malformed (its connection is closed). Any other exception is the driver's own failure:
        logged at ERROR, the message acknowledged, the connection kept."""

    def detached(self, node: int) -> None:
        """A node's connection ended (it may reconnect)."""


class MalformedMessage(ProtocolError):
    """An authenticated node sent a message the handler could not take (a bug on one side)."""


@dataclass(eq=False)
class _Pending:
    """A connection in its handshake (owned by the handshake thread)."""

    sock: socket.socket
    addr: Any
    deadline: float
    challenge: ServerChallenge
    answer: bytearray = field(default_factory=bytearray)

    @property
    def host(self) -> str:
        return str(self.addr[0]) if isinstance(self.addr, tuple) and self.addr else str(self.addr)


class ChannelServer:
    """Driver side: accepts authenticated node connections and hands their messages on.

    ``trusted`` are the IP addresses of the executors the driver knows: their handshakes wait in
    slots strangers cannot take (:mod:`spark_torch.channel.handshake_slots`).
    """

    def __init__(
        self,
        host: str,
        secret: bytes,
        handler: ServerHandler,
        *,
        nodes: int,
        ports: tuple[int, int] | None = None,
        heartbeat: float = 2.0,
        trusted: Iterable[str] = (),
    ) -> None:
        self._secret = secret
        self._handler = handler
        self._nodes = nodes
        self._heartbeat = heartbeat
        self._listener = bind_listener(host, ports)
        self._listener.setblocking(False)
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._links: dict[int, Link] = {}
        self._threads: set[threading.Thread] = set()
        self._last_seq: dict[int, int] = {}
        #: serializes handler calls per node, across its connections
        self._node_locks = [threading.Lock() for _ in range(nodes)]
        # handshake thread only: pending connections in arrival (= deadline) order
        self._pending: collections.OrderedDict[socket.socket, _Pending] = collections.OrderedDict()
        self._slots: HandshakeSlots[socket.socket] = HandshakeSlots(
            trusted,
            total=MAX_PENDING_HANDSHAKES,
            per_address=MAX_PENDING_PER_ADDRESS,
            trusted_per_address=MAX_PENDING_PER_TRUSTED_ADDRESS,
            min_age=MIN_HANDSHAKE_AGE,
        )
        self._selector = selectors.DefaultSelector()
        self._wake_read, self._wake_write = socket.socketpair()
        self._wake_read.setblocking(False)
        self.rejected = 0
        #: of those: newcomers refused (their slots were full of handshakes under a second old)
        self.refused = 0
        #: of those: pending handshakes closed to make room for a newcomer
        self.evicted = 0
        self._warn = RateLimitedLog(logger, logging.WARNING)
        # its own line: a flood of strangers' rejections must not hide an attack on a live connection
        self._tampered = RateLimitedLog(logger, logging.WARNING)
        self._error = RateLimitedLog(logger, logging.ERROR)
        self._accepter = threading.Thread(target=self._handshake_loop, name="spark-torch-channel-accept", daemon=True)
        self._accepter.start()

    def _reject(self, addr: Any, why: str, *, closing: socket.socket | Link | None = None, kind: str = "") -> None:
        """Count a rejection (and its ``kind``: "refused" or "evicted"), then close ``closing``:
        whoever sees the connection close sees it counted."""
        with self._lock:
            self.rejected += 1
            if kind == "refused":
                self.refused += 1
            elif kind == "evicted":
                self.evicted += 1
        if closing is not None:
            closing.close()
        self._warn("spark_torch channel: rejected a connection from %s: %s", addr, why)

    # the handshake thread

    def _handshake_loop(self) -> None:
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._selector.register(self._wake_read, selectors.EVENT_READ)
        try:
            while not self._closed.is_set():
                timeout = None
                if self._pending:
                    oldest = next(iter(self._pending.values()))
                    timeout = max(0.0, oldest.deadline - time.monotonic())
                accept = False
                for key, _ in self._selector.select(timeout):
                    if key.fileobj is self._listener:
                        accept = True
                    elif key.fileobj is self._wake_read:
                        self._wake_read.recv(64)
                    else:
                        pending: _Pending = key.data
                        if self._pending.get(pending.sock) is pending:  # not evicted earlier in this batch
                            self._answer_ready(pending)
                if accept:  # after the answers that arrived: newcomers may push out the oldest
                    self._accept_ready()
                now = time.monotonic()
                while self._pending:
                    oldest = next(iter(self._pending.values()))
                    if oldest.deadline > now:
                        break
                    self._drop(oldest, f"no answer within the {HANDSHAKE_SECONDS:g}s handshake deadline")
        finally:
            for pending in list(self._pending.values()):
                self._drop(pending, "the channel closed during its handshake")
            self._selector.close()
            self._listener.close()

    def _forget(self, pending: _Pending) -> None:
        del self._pending[pending.sock]
        self._slots.remove(pending.sock)
        self._selector.unregister(pending.sock)

    def _drop(self, pending: _Pending, why: str) -> None:
        self._forget(pending)
        self._reject(pending.addr, why, closing=pending.sock)

    def _accept_ready(self) -> None:
        for _ in range(_ACCEPT_BURST):
            try:
                conn, addr = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:  # e.g. out of file descriptors: do not spin
                if not self._closed.is_set():
                    self._warn("spark_torch channel: accept failed (%s); retrying", exc)
                    self._closed.wait(0.1)
                return
            now = time.monotonic()
            pending = _Pending(conn, addr, now + HANDSHAKE_SECONDS, ServerChallenge(self._secret))
            admission = self._slots.admit(conn, pending.host, now)
            if not admission.admitted:
                self._reject(
                    addr,
                    f"refused: its handshake slots are full of handshakes under {MIN_HANDSHAKE_AGE:g}s old",
                    closing=conn,
                    kind="refused",
                )
                continue
            if admission.evict is not None:
                victim = self._pending.pop(admission.evict)  # the slots already forgot it
                self._selector.unregister(victim.sock)
                self._reject(
                    victim.addr,
                    "replaced by a newer connection: its handshake slots were full",
                    closing=victim.sock,
                    kind="evicted",
                )
            try:
                conn.setblocking(False)
                # a fresh socket's send buffer always takes the greeting whole
                if conn.send(pending.challenge.greeting) != len(pending.challenge.greeting):
                    raise ConnectionError("the greeting did not fit the socket buffer")
            except OSError as exc:
                self._slots.remove(conn)
                self._reject(addr, f"handshake failed ({type(exc).__name__}: {exc})", closing=conn)
                continue
            self._pending[conn] = pending
            self._selector.register(conn, selectors.EVENT_READ, pending)

    def _answer_ready(self, pending: _Pending) -> None:
        try:
            data = pending.sock.recv(ANSWER_BYTES - len(pending.answer))
        except BlockingIOError:
            return
        except OSError as exc:
            self._drop(pending, f"handshake failed ({type(exc).__name__}: {exc})")
            return
        if not data:
            self._drop(pending, "closed during the handshake")
            return
        pending.answer += data
        if len(pending.answer) < ANSWER_BYTES:
            return
        try:
            proof, keys = pending.challenge.check(bytes(pending.answer))
        except AuthenticationError as exc:
            self._drop(pending, f"handshake failed ({exc})")
            return
        self._forget(pending)
        conn = pending.sock
        try:
            if conn.send(proof) != len(proof):  # as the greeting: it always fits
                raise ConnectionError("the proof did not fit the socket buffer")
            conn.setblocking(True)
            tune_socket(conn, self._heartbeat)
            link = Link(conn, keys, server=True, idle_timeout=self._heartbeat * DEAD_AFTER)
        except OSError as exc:
            self._reject(pending.addr, f"handshake failed ({type(exc).__name__}: {exc})", closing=conn)
            return
        thread = threading.Thread(
            target=self._serve, args=(link, pending.addr), name="spark-torch-channel-conn", daemon=True
        )
        with self._lock:
            if self._closed.is_set():
                link.close()
                return
            self._threads.add(thread)
        try:
            thread.start()
        except RuntimeError as exc:  # cannot start a thread: refuse this peer, keep serving
            with self._lock:
                self._threads.discard(thread)
            self._reject(pending.addr, f"cannot start a thread ({exc})", closing=link)

    # one thread per attached node

    def _serve(self, link: Link, addr: Any) -> None:
        node = -1
        current = False
        try:
            try:
                first = link.recv()
            except (ProtocolError, AuthenticationError):
                raise  # tampering (or a bug) on an authenticated connection: below
            except (OSError, ConnectionError) as exc:
                self._reject(addr, f"no attach after the handshake ({type(exc).__name__}: {exc})")
                return
            attach = first.get("attach")
            if isinstance(attach, bool) or not isinstance(attach, int) or not 0 <= attach < self._nodes:
                self._reject(addr, f"an authenticated peer attached as node {attach!r} (expected 0..{self._nodes - 1})")
                return
            node = attach
            with self._lock:
                if self._closed.is_set():
                    return
                previous = self._links.get(node)
                self._links[node] = link
            if previous is not None:
                previous.close()  # the node reconnected: its old connection is dead to it
            with self._node_locks[node]:
                replay = self._handler.attached(node)
            for message in replay:
                link.send(message)
            self._receive(link, node)
        except (ProtocolError, AuthenticationError) as exc:  # a bug on one side, or an attack
            self._tampered(
                "spark_torch channel: dropped an authenticated connection (node %s, from %s): %s",
                "?" if node < 0 else node,
                addr,
                exc,
            )
        except (OSError, ConnectionError) as exc:
            if not self._closed.is_set() and not isinstance(exc, (ConnectionResetError, BrokenPipeError)):
                logger.debug("spark_torch channel: node %s disconnected: %s", node, exc)
        except Exception as exc:  # noqa: BLE001 - the handler's attached(): the driver's own failure
            self._error(
                "spark_torch channel: the driver failed to attach node %s: %s: %s", node, type(exc).__name__, exc
            )
        finally:
            with self._lock:
                self._threads.discard(threading.current_thread())
                current = node >= 0 and self._links.get(node) is link
                if current:
                    del self._links[node]
            link.close()
            if current:
                with self._node_locks[node]:
                    try:
                        self._handler.detached(node)
                    except Exception as exc:  # noqa: BLE001 - logged, never a dead thread's traceback
                        self._error("spark_torch channel: the driver failed to detach node %s: %s", node, exc)

    def _receive(self, link: Link, node: int) -> None:
        lock = self._node_locks[node]
        while True:
            message = link.recv()
            if "ping" in message:
                link.send({"pong": 1})
                continue
            seq = message.get("seq")
            if isinstance(seq, bool) or not isinstance(seq, int):
                raise ProtocolError(f"a message without a sequence number ({sorted(message)[:5]})")
            with lock:  # the check and the call: a reconnect's thread waits, then sees a repeat
                if seq > self._last_seq.get(node, 0):
                    # consumed even if handling fails below: a malformed message resent after the
                    # reconnect is then acknowledged as a repeat instead of looping forever
                    self._last_seq[node] = seq
                    self._handle(node, message)
            link.send({"ack": seq})

    def _handle(self, node: int, message: dict[str, Any]) -> None:
        try:
            self._handler.message(node, message)
        except (ValueError, TypeError, KeyError) as exc:
            raise MalformedMessage(f"a malformed message ({type(exc).__name__}: {exc})") from exc
        except Exception as exc:  # noqa: BLE001 - the driver's own failure (disk full...), not the connection's
            kind = next((k for k in message if k != "seq"), "?")
            self._error(
                "spark_torch channel: the driver failed to handle a %r message of node %s: %s: %s",
                kind,
                node,
                type(exc).__name__,
                exc,
            )

    def send(self, node: int, message: dict[str, Any]) -> bool:
        """Send to one node if it is connected (it gets the state again when it reattaches)."""
        return self._send_body(node, encode(message))

    def _send_body(self, node: int, body: Any) -> bool:
        with self._lock:
            link = self._links.get(node)
        if link is None:
            return False
        try:
            link.send_body(body)
            return True
        except OSError:
            return False

    def broadcast(self, message: dict[str, Any]) -> None:
        """Send to every connected node (encoded once: a rendezvous decision carries every hello)."""
        body = encode(message)
        with self._lock:
            nodes = list(self._links)
        for node in nodes:
            self._send_body(node, body)

    def connected(self) -> set[int]:
        """Nodes with a live connection."""
        with self._lock:
            return set(self._links)

    def close(self) -> None:
        """Stop listening, close every connection and wait for every thread of this server."""
        with self._lock:
            self._closed.set()
            links = list(self._links.values())
            threads = list(self._threads)
        try:
            self._wake_write.send(b"x")  # the handshake thread closes the listener and pending peers
        except OSError:
            pass
        for link in links:
            link.close()
        deadline = time.monotonic() + JOIN_SECONDS
        for thread in [self._accepter, *threads]:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))
        if not self._accepter.is_alive():
            self._wake_read.close()
            self._wake_write.close()
        self._warn.flush("spark_torch channel: rejected connections")
        self._tampered.flush("spark_torch channel: dropped authenticated connections")
        self._error.flush("spark_torch channel: failures handling node messages")
