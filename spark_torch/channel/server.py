"""The driver end of the reliable channel (:mod:`spark_torch.channel.transport`): accepts
authenticated node connections, hands their numbered messages on exactly once, acknowledges
them, answers heartbeats, and sends the driver's state to (re)attaching nodes."""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any, Protocol

from spark_torch.channel.transport import (
    DEAD_AFTER,
    HANDSHAKE_SECONDS,
    JOIN_SECONDS,
    MAX_PENDING_HANDSHAKES,
    bind_listener,
)
from spark_torch.channel.wire import Link, ProtocolError, server_handshake, tune_socket

__all__ = ["ChannelServer", "ServerHandler"]

logger = logging.getLogger(__name__)


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
