"""Reliable delivery over authenticated links (:mod:`spark_torch.channel.wire`): reconnects, acks, heartbeats.

Node -> driver messages are numbered per node and kept until the driver acknowledges them;
after a reconnect they are resent and the driver drops repeats, so nothing is lost or doubled.
Driver -> node messages are state (a rendezvous decision, a stop), which the driver replays to a
node every time it (re)attaches. A node sends a heartbeat whenever it has been quiet for
``heartbeat`` seconds and the driver answers it; either end gives a connection up after
``DEAD_AFTER`` heartbeats of silence, so an idle drop by a firewall, NAT or cloud load
balancer is noticed within seconds and the node reconnects (TCP keepalive is the backstop).

The driver side bounds what strangers can cost: a deadline on the whole handshake, at most
``MAX_PENDING_HANDSHAKES`` unauthenticated connections at once, one connection per node, and
no thread survives :meth:`ChannelServer.close`.
"""

from __future__ import annotations

import errno
import logging
import random
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from spark_torch.channel.wire import (
    Body,
    Link,
    ProtocolError,
    client_handshake,
    encode,
    server_handshake,
    tune_socket,
)

__all__ = ["ChannelServer", "ChannelClient", "ServerHandler", "Outbox", "bind_listener", "PortsUnavailable"]

logger = logging.getLogger(__name__)

HANDSHAKE_SECONDS = 5.0
#: a connection silent for this many heartbeats is given up (and re-established by the node)
DEAD_AFTER = 4
MAX_PENDING_HANDSHAKES = 16
#: frames sent but not yet acknowledged before the node waits for the driver
WINDOW = 64
#: reconnect backoff bounds (seconds)
BACKOFF_MIN, BACKOFF_MAX = 0.05, 2.0
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
            sock.listen(64)
            return sock
        except OSError as exc:
            sock.close()
            if exc.errno not in (errno.EADDRINUSE, errno.EACCES):
                raise
            last = exc
    assert ports is not None
    raise PortsUnavailable(f"no free port in {ports[0]}-{ports[1]} on {host} ({last})")


class ServerHandler(Protocol):
    """What the driver side does with nodes and their messages (called from connection threads)."""

    def attached(self, node: int) -> list[dict[str, Any]]:
        """A node (re)connected; returns the messages to (re)send to it (current state)."""

    def message(self, node: int, message: dict[str, Any]) -> None:
        """A node's numbered message, exactly once; raise ValueError/TypeError if malformed."""

    def detached(self, node: int) -> None:
        """A node's connection ended (it may reconnect)."""


class ChannelServer:
    """Driver side: accepts authenticated node connections and hands their messages on."""

    def __init__(
        self,
        host: str,
        secret: bytes,
        handler: ServerHandler,
        *,
        nodes: int,
        ports: tuple[int, int] | None = None,
        heartbeat: float = 2.0,
    ) -> None:
        self._secret = secret
        self._handler = handler
        self._nodes = nodes
        self._heartbeat = heartbeat
        self._listener = bind_listener(host, ports)
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._links: dict[int, Link] = {}
        self._sockets: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        self._last_seq: dict[int, int] = {}
        self._pending = threading.BoundedSemaphore(MAX_PENDING_HANDSHAKES)
        self.rejected = 0
        self._accepter = threading.Thread(target=self._accept_loop, name="spark-torch-channel-accept", daemon=True)
        self._accepter.start()

    def _reject(self, addr: Any, why: str) -> None:
        with self._lock:
            self.rejected += 1
        logger.warning("spark_torch channel: rejected a connection from %s: %s", addr, why)

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                conn, addr = self._listener.accept()
            except OSError as exc:
                if self._closed.is_set():
                    return
                logger.warning("spark_torch channel: accept failed (%s); retrying", exc)
                self._closed.wait(0.1)  # e.g. out of file descriptors: do not spin
                continue
            if not self._pending.acquire(blocking=False):
                conn.close()
                self._reject(addr, f"more than {MAX_PENDING_HANDSHAKES} connections are authenticating at once")
                continue
            thread = threading.Thread(target=self._serve, args=(conn, addr), name="spark-torch-channel-conn", daemon=True)
            with self._lock:
                if self._closed.is_set():
                    conn.close()
                    self._pending.release()
                    return
                self._sockets.add(conn)
                self._threads.add(thread)
            try:
                thread.start()
            except RuntimeError as exc:  # cannot start a thread: refuse this peer, keep accepting
                with self._lock:
                    self._sockets.discard(conn)
                    self._threads.discard(thread)
                conn.close()
                self._pending.release()
                self._reject(addr, f"cannot start a thread ({exc})")

    def _authenticate(self, conn: socket.socket, addr: Any) -> tuple[Link, int] | None:
        try:
            tune_socket(conn, self._heartbeat)
            link = server_handshake(conn, self._secret, time.monotonic() + HANDSHAKE_SECONDS, self._heartbeat * DEAD_AFTER)
            first = link.recv()
        except (OSError, ConnectionError) as exc:  # includes timeouts and failed proofs
            self._reject(addr, f"handshake failed ({type(exc).__name__}: {exc})")
            return None
        finally:
            self._pending.release()
        node = first.get("attach")
        if isinstance(node, bool) or not isinstance(node, int) or not 0 <= node < self._nodes:
            self._reject(addr, f"an authenticated peer attached as node {node!r} (expected 0..{self._nodes - 1})")
            return None
        return link, node

    def _serve(self, conn: socket.socket, addr: Any) -> None:
        link: Link | None = None
        node = -1
        try:
            authenticated = self._authenticate(conn, addr)
            if authenticated is None:
                return
            link, node = authenticated
            with self._lock:
                if self._closed.is_set():
                    return
                previous = self._links.get(node)
                self._links[node] = link
            if previous is not None:
                previous.close()  # the node reconnected: its old connection is dead to it
            for message in self._handler.attached(node):
                link.send(message)
            self._receive(link, node)
        except (OSError, ConnectionError) as exc:
            if not self._closed.is_set() and not isinstance(exc, (ConnectionResetError, BrokenPipeError)):
                logger.debug("spark_torch channel: node %s disconnected: %s", node, exc)
        except Exception as exc:  # noqa: BLE001 - a malformed frame closes its connection, never the server
            logger.warning("spark_torch channel: dropped the connection of node %s: %s: %s", node, type(exc).__name__, exc)
        finally:
            with self._lock:
                self._sockets.discard(conn)
                self._threads.discard(threading.current_thread())
                current = link is not None and self._links.get(node) is link
                if current:
                    del self._links[node]
            if link is not None:
                link.close()
            else:
                conn.close()
            if current:
                self._handler.detached(node)

    def _receive(self, link: Link, node: int) -> None:
        while True:
            message = link.recv()
            if "ping" in message:
                link.send({"pong": 1})
                continue
            seq = message.get("seq")
            if isinstance(seq, bool) or not isinstance(seq, int):
                raise ProtocolError(f"a message without a sequence number ({sorted(message)[:5]})")
            with self._lock:
                fresh = seq > self._last_seq.get(node, 0)
                if fresh:
                    # consumed even if handling fails below: a malformed message resent after the
                    # reconnect is then acknowledged as a repeat instead of looping forever
                    self._last_seq[node] = seq
            if fresh:
                self._handler.message(node, message)
            link.send({"ack": seq})

    def send(self, node: int, message: dict[str, Any]) -> bool:
        """Send to one node if it is connected (it gets the state again when it reattaches)."""
        with self._lock:
            link = self._links.get(node)
        if link is None:
            return False
        try:
            link.send(message)
            return True
        except OSError:
            return False

    def broadcast(self, message: dict[str, Any]) -> None:
        """Send to every connected node."""
        with self._lock:
            nodes = list(self._links)
        for node in nodes:
            self.send(node, message)

    def connected(self) -> set[int]:
        """Nodes with a live connection."""
        with self._lock:
            return set(self._links)

    def close(self) -> None:
        """Stop listening, close every connection and wait for every thread of this server."""
        with self._lock:
            self._closed.set()
            links = list(self._links.values())
            sockets = list(self._sockets)
            threads = list(self._threads)
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept() on Linux
        except OSError:
            pass
        self._listener.close()
        for link in links:
            link.close()
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        deadline = time.monotonic() + JOIN_SECONDS
        for thread in [self._accepter, *threads]:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))


class Outbox(Protocol):
    """Where a :class:`ChannelClient` takes its numbered messages from (called under ``cond``)."""

    def pending(self) -> bool:
        """Whether :meth:`take` would return something."""

    def take(self) -> list[dict[str, Any]]:
        """Messages to send next, each small enough to fit a frame with its sequence number."""


class ChannelClient:
    """Node side: keeps one authenticated connection to the driver up and delivers messages once.

    ``on_message`` gets every driver message that is not an ack or heartbeat (from a reader
    thread). :meth:`send` queues a control message; an ``outbox`` (sharing :attr:`cond`)
    provides the bulk of the traffic. Connection failures are retried with backoff until
    :meth:`close`; :attr:`last_error` keeps the latest one for error messages.
    """

    def __init__(
        self,
        host: str,
        port: int,
        secret: bytes,
        node: int,
        on_message: Callable[[dict[str, Any]], None],
        *,
        outbox: Outbox | None = None,
        heartbeat: float = 2.0,
        cond: threading.Condition | None = None,
    ) -> None:
        self._address = (host, port)
        self._secret = secret
        self._node = node
        self._on_message = on_message
        self._outbox = outbox
        self._heartbeat = heartbeat
        self.cond = cond or threading.Condition()
        self._control: deque[dict[str, Any]] = deque()
        self._unacked: list[tuple[int, Body]] = []
        self._seq = 0
        self._link: Link | None = None
        self._connecting: socket.socket | None = None
        self._link_alive = False
        self._readers: list[threading.Thread] = []
        self._closing = threading.Event()
        #: set once a handshake with the driver succeeded (ever)
        self.attached = threading.Event()
        self.last_error: str | None = None
        self.connects = 0
        self._sender = threading.Thread(target=self._send_loop, name="spark-torch-channel-client", daemon=True)
        self._sender.start()

    @property
    def address(self) -> str:
        """``host:port`` of the driver's channel, for messages."""
        host, port = self._address
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def send(self, message: dict[str, Any], *, block_until: float | None = None) -> None:
        """Queue a control message (delivered once, in order, before queued outbox messages).

        With ``block_until`` (a monotonic deadline) wait first until fewer than ``WINDOW``
        messages are queued or unacknowledged (bulk data: memory stays bounded); raises
        ``TimeoutError`` at the deadline and ``ConnectionError`` when the client closes.
        """
        with self.cond:
            if block_until is not None:
                while len(self._control) + len(self._unacked) >= WINDOW:
                    if self._closing.is_set():
                        raise ConnectionError("the channel client is closing")
                    remaining = block_until - time.monotonic()
                    if remaining <= 0:
                        raise TimeoutError(f"the driver at {self.address} took no data for too long")
                    self.cond.wait(min(remaining, 0.5))
            self._control.append(message)
            self.cond.notify_all()

    def idle(self) -> bool:
        """Nothing queued and everything sent was acknowledged (call under :attr:`cond`)."""
        return not self._control and not self._unacked and not (self._outbox is not None and self._outbox.pending())

    def _connect(self) -> Link:
        sock = socket.create_connection(self._address, timeout=HANDSHAKE_SECONDS)
        with self.cond:
            self._connecting = sock  # close() shuts it down instead of waiting out the handshake
        if self._closing.is_set():
            sock.close()
            raise ConnectionError("closing")
        try:
            tune_socket(sock, self._heartbeat)
            link = client_handshake(sock, self._secret, time.monotonic() + HANDSHAKE_SECONDS, self._heartbeat * DEAD_AFTER)
            link.send({"attach": self._node})
        except BaseException:
            sock.close()
            raise
        finally:
            with self.cond:
                self._connecting = None
        reader = threading.Thread(target=self._read_loop, args=(link,), name="spark-torch-channel-reader", daemon=True)
        self.attached.set()  # the driver proved the run's secret: it is reachable
        with self.cond:
            self._link, self._link_alive = link, True
            self._readers = [t for t in self._readers if t.is_alive()] + [reader]
        reader.start()
        return link

    def _read_loop(self, link: Link) -> None:
        try:
            while True:
                message = link.recv()
                if "ack" in message:
                    acked = message["ack"]
                    if isinstance(acked, int):
                        with self.cond:
                            self._unacked = [f for f in self._unacked if f[0] > acked]
                            self.cond.notify_all()
                elif "pong" not in message:
                    self._on_message(message)
        except Exception as exc:  # noqa: BLE001 - any failure ends this connection; the sender reconnects
            if not self._closing.is_set():
                self.last_error = f"connection to {self.address} lost: {type(exc).__name__}: {exc}"
        finally:
            with self.cond:
                if self._link is link:
                    self._link_alive = False
                self.cond.notify_all()  # wake the sender: it reconnects at once
            link.close()

    def _numbered(self, message: dict[str, Any]) -> tuple[int, Body]:
        self._seq += 1
        return self._seq, encode({**message, "seq": self._seq})

    def _next_frames(self, last_sent: float) -> tuple[list[tuple[int, Body]], bool]:
        """Wait (under cond) for work; returns new frames and whether a heartbeat is due."""
        with self.cond:
            while True:
                if self._closing.is_set() or not self._link_alive:
                    return [], False
                window_open = len(self._unacked) < WINDOW
                if self._control or (window_open and self._outbox is not None and self._outbox.pending()):
                    break
                wait = last_sent + self._heartbeat - time.monotonic()
                if wait <= 0:
                    return [], True
                self.cond.wait(wait)
            messages = list(self._control)
            self._control.clear()
            if window_open and self._outbox is not None:
                messages += self._outbox.take()
            frames = [self._numbered(m) for m in messages]
            self._unacked += frames
            return frames, False

    def _send_loop(self) -> None:
        backoff = BACKOFF_MIN
        last_sent = time.monotonic()
        while not self._closing.is_set():
            try:
                with self.cond:
                    link, alive = self._link, self._link_alive
                if not alive:
                    if link is not None:
                        link.close()
                    link = self._connect()
                    self.connects += 1
                    backoff = BACKOFF_MIN
                    with self.cond:
                        resend = list(self._unacked)
                    for _seq, body in resend:
                        link.send_body(body)
                    last_sent = time.monotonic()
                assert link is not None
                frames, heartbeat = self._next_frames(last_sent)
                for _seq, body in frames:
                    link.send_body(body)
                if heartbeat:
                    link.send({"ping": 1})
                if frames or heartbeat:
                    last_sent = time.monotonic()
            except Exception as exc:  # noqa: BLE001 - retried; the latest error is kept for messages
                if self._closing.is_set():
                    break
                self.last_error = f"cannot reach {self.address}: {type(exc).__name__}: {exc}"
                with self.cond:
                    self._link_alive = False
                self._closing.wait(backoff * (0.5 + random.random()))  # jittered reconnect backoff
                backoff = min(backoff * 2, BACKOFF_MAX)
        with self.cond:
            link = self._link
        if link is not None:
            link.close()

    def drain(self, timeout: float) -> bool:
        """Wait until everything queued was acknowledged; False on timeout (or never attached
        and no connection now)."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while not self.idle():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self.cond.wait(min(remaining, 0.5))
        return True

    def close(self) -> None:
        """Stop at once: close the connection and wait for this client's threads."""
        self._closing.set()
        with self.cond:
            self.cond.notify_all()
            link, connecting = self._link, self._connecting
        if connecting is not None:
            try:
                connecting.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if link is not None:
            link.close()
        deadline = time.monotonic() + JOIN_SECONDS
        for thread in [self._sender, *self._readers]:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))
