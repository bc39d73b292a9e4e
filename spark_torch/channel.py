"""The authenticated log/control channel between node runners on executors and the driver.

Driver side, :class:`LogServer`: listens on the driver host (never 0.0.0.0) on a port the OS
picks, for one run. Every connection must answer a challenge with
``HMAC-SHA256(secret, nonce)`` within a few seconds, or it is closed and logged. After that,
frames are ``4-byte big-endian length + UTF-8 JSON`` of at most :data:`MAX_FRAME` bytes; a
frame that is too large, not JSON, or not a known message closes that connection (the run is
unaffected). Bytes are only ever decoded as text, never unpickled.

Executor side, :class:`LogClient`: queues lines without blocking (a full queue drops lines and
counts them), sends them from a thread, reconnects with backoff when the connection drops,
and reports dropped counts. The driver can send ``{"stop": reason}`` to make the node stop its
ranks (timeout, Ctrl-C, another node failed).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from .processes import block_lines

__all__ = ["LogServer", "LogClient", "MAX_FRAME", "new_secret"]

logger = logging.getLogger(__name__)

MAX_FRAME = 1024 * 1024
#: pseudo stream of rank state changes (``started``/``finished``/``failed``) among the lines
EVENT_STREAM = "event"
#: queue marker: send this node's rendezvous hello
HELLO_STREAM = "hello"
NONCE_BYTES = 32
HANDSHAKE_SECONDS = 5.0
_HEADER = struct.Struct(">I")
_OK = b"OK"


def new_secret() -> bytes:
    """A fresh per-run key."""
    return os.urandom(32)


def _digest(secret: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret, b"spark-torch-log-v1" + nonce, hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("connection closed")
        data += chunk
    return bytes(data)


class FrameTooLarge(ValueError):
    """A message that would exceed :data:`MAX_FRAME` once encoded."""


def _encode(message: dict[str, Any]) -> bytes:
    body = json.dumps(message, ensure_ascii=False).encode("utf-8")
    if len(body) > MAX_FRAME:
        raise FrameTooLarge("frame too large")
    return body


def _send_body(sock: socket.socket, body: bytes) -> None:
    sock.sendall(_HEADER.pack(len(body)) + body)


def _send_frame(sock: socket.socket, message: dict[str, Any]) -> None:
    _send_body(sock, _encode(message))


def _recv_frame(sock: socket.socket) -> dict[str, Any]:
    (size,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    if size > MAX_FRAME:
        raise ValueError(f"frame of {size} bytes exceeds the {MAX_FRAME} byte limit")
    message = json.loads(_recv_exact(sock, size).decode("utf-8"))
    if not isinstance(message, dict):
        raise ValueError("frame is not a JSON object")
    return message


#: receives ``(rank, stream, block)``: complete lines joined by "\n"
LinesHandler = Callable[[int, str, str], None]


class LogServer:
    """Receives rank output from node runners; can tell them to stop."""

    def __init__(self, host: str, secret: bytes, on_lines: LinesHandler) -> None:
        self._secret = secret
        self._on_lines = on_lines
        self._flush = getattr(on_lines, "flush", None)
        self._rank_event = getattr(on_lines, "rank_event", None)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.bind((host, 0))
        self._listener.listen(64)
        self.host = host
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._peers: list[socket.socket] = []
        self._send_locks: dict[socket.socket, threading.Lock] = {}
        self._last_seq: dict[int, int] = {}
        self._eof = threading.Condition(self._lock)
        self.finished_nodes: set[int] = set()
        self.dropped = 0
        self.rejected = 0
        self._closed = False
        #: rendezvous: what each node said in its hello, and the reply once all nodes did
        self._expected_nodes: int | None = None
        self._hellos: dict[int, dict[str, Any]] = {}
        self._peers_reply: dict[str, Any] | None = None
        self._accepter = threading.Thread(target=self._accept_loop, name="spark-torch-log-server", daemon=True)
        self._accepter.start()

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, addr = self._listener.accept()
            except OSError:
                return
            threading.Thread(
                target=self._serve, args=(conn, addr), name="spark-torch-log-conn", daemon=True
            ).start()

    def _reject(self, conn: socket.socket, addr: Any, why: str) -> None:
        with self._lock:
            self.rejected += 1
        logger.warning("spark_torch log channel: rejected connection from %s: %s", addr, why)
        conn.close()

    def _serve(self, conn: socket.socket, addr: Any) -> None:
        try:
            conn.settimeout(HANDSHAKE_SECONDS)
            nonce = os.urandom(NONCE_BYTES)
            conn.sendall(nonce)
            answer = _recv_exact(conn, hashlib.sha256().digest_size)
            if not hmac.compare_digest(answer, _digest(self._secret, nonce)):
                self._reject(conn, addr, "authentication failed")
                return
            conn.sendall(_OK)
            conn.settimeout(None)
        except (OSError, ConnectionError) as exc:
            self._reject(conn, addr, f"handshake failed ({exc})")
            return
        with self._lock:
            if self._closed:
                conn.close()
                return
            self._peers.append(conn)
            self._send_locks[conn] = threading.Lock()
        try:
            while True:
                message = _recv_frame(conn)
                seq, node = message.get("seq"), message.get("node")
                if isinstance(seq, int) and isinstance(node, int):
                    with self._lock:
                        fresh = seq > self._last_seq.get(node, 0)
                        if fresh:
                            self._last_seq[node] = seq
                    if fresh:  # a frame resent after a reconnect is acknowledged, not repeated
                        self._handle(message, conn)
                    self._send(conn, {"ack": seq})
                else:
                    self._handle(message, conn)
        except ConnectionError:
            pass
        except (ValueError, OSError, UnicodeDecodeError) as exc:
            logger.warning("spark_torch log channel: dropped a connection from %s: %s", addr, exc)
        finally:
            with self._lock:
                if conn in self._peers:
                    self._peers.remove(conn)
                self._send_locks.pop(conn, None)
            conn.close()

    def _send(self, conn: socket.socket, message: dict[str, Any]) -> None:
        with self._lock:
            lock = self._send_locks.get(conn)
        if lock is None:
            return
        with lock:
            _send_frame(conn, message)

    def expect_nodes(self, nodes: int) -> None:
        """Act as the rendezvous of ``nodes`` node runners (see :meth:`LogClient.rendezvous`)."""
        with self._lock:
            self._expected_nodes = nodes

    def _hello(self, hello: Any, conn: socket.socket) -> None:
        """A node's hello: once every node said hello, every node gets all hellos, in node order."""
        if not isinstance(hello, dict) or not isinstance(hello.get("node"), int):
            raise ValueError("a hello must be an object with an integer node")
        with self._lock:
            if self._expected_nodes is None or not 0 <= hello["node"] < self._expected_nodes:
                raise ValueError(f"unexpected hello from node {hello.get('node')}")
            self._hellos.setdefault(hello["node"], hello)
            reply = self._peers_reply
            if reply is None and len(self._hellos) == self._expected_nodes:
                reply = self._peers_reply = {"peers": [self._hellos[n] for n in range(self._expected_nodes)]}
                targets = list(self._peers)
            else:
                targets = [conn]  # a node that reconnected after the reply went out
        if reply is not None:
            for peer in targets:
                try:
                    self._send(peer, reply)
                except OSError:
                    pass  # that node reconnects and says hello again

    def _handle(self, message: dict[str, Any], conn: socket.socket | None = None) -> None:
        if "hello" in message:
            if conn is not None:
                self._hello(message["hello"], conn)
            return
        if "lines" in message:
            # [[rank, stream, block], ...]: a block is lines joined by "\n"; the "event" stream
            # carries a rank's state instead
            for rank, stream, payload in message["lines"]:
                if not isinstance(payload, str):
                    raise ValueError("a block of lines must be a string")
                if stream == EVENT_STREAM:
                    if self._rank_event is not None:
                        self._rank_event(int(rank), payload)
                    continue
                self._on_lines(int(rank), str(stream), payload)
            if self._flush is not None:
                self._flush()
        elif "dropped" in message:
            count = int(message["dropped"])
            with self._lock:
                self.dropped += count
            self._on_lines(-1, "stderr", f"[spark_torch] {count} log line(s) dropped on node {message.get('node')}")
        elif "eof" in message:
            with self._eof:
                self.finished_nodes.add(int(message["eof"]))
                self._eof.notify_all()
        else:
            raise ValueError(f"unknown message {sorted(message)}")

    def wait_for_nodes(self, nodes: int, timeout: float) -> bool:
        """Wait until ``nodes`` node runners said they sent everything (drain), bounded."""
        deadline = time.monotonic() + timeout
        with self._eof:
            while len(self.finished_nodes) < nodes:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._eof.wait(remaining)
        return True

    def stop_nodes(self, reason: str) -> None:
        """Ask every connected node runner to stop its ranks now."""
        with self._lock:
            peers = list(self._peers)
        for peer in peers:
            try:
                self._send(peer, {"stop": reason})
            except OSError:
                pass

    def close(self) -> None:
        """Stop listening and close every connection."""
        with self._lock:
            self._closed = True
            peers = list(self._peers)
        try:
            self._listener.close()
        except OSError:
            pass
        for peer in peers:
            try:
                peer.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            peer.close()


class LogClient:
    """Node-runner side: a non-blocking line sink that ships lines to the driver.

    Blocks of lines are queued without blocking (beyond :attr:`QUEUE_LINES` queued lines new
    blocks are dropped and counted), packed into numbered frames, and kept until the driver
    acknowledges them; after a dropped connection the client reconnects and resends what was
    not acknowledged (the driver ignores repeats), so a connection drop loses no line.
    """

    #: lines queued before new ones are dropped (and counted); ~100 MB of 500-byte lines
    QUEUE_LINES = 200_000
    #: a frame carries about this many characters of queued lines
    FRAME_TEXT_BYTES = MAX_FRAME // 8
    #: frames sent but not yet acknowledged before the sender waits for the driver
    WINDOW = 64

    def __init__(self, host: str, port: int, secret: bytes, node_rank: int, on_stop: Callable[[str], None]) -> None:
        self._address = (host, port)
        self._secret = secret
        self._node = node_rank
        self._on_stop = on_stop
        #: (rank, stream, block, lines in it), (rank, "event", state, 0), or None = end of stream
        self._queue: deque[tuple[int, str, str, int] | None] = deque()
        self._queued_lines = 0
        self._queue_ready = threading.Condition()
        self._dropped = 0
        self._seq = 0
        self._unacked: list[tuple[int, bytes]] = []
        self._acks = threading.Condition()
        self._sock: socket.socket | None = None
        self._sock_alive = False
        self._closing = threading.Event()
        self._hello: dict[str, Any] | None = None
        self._peers: list[dict[str, Any]] | None = None
        self._peers_ready = threading.Event()
        self._sender = threading.Thread(target=self._send_loop, name="spark-torch-log-client", daemon=True)
        self._sender.start()

    def __call__(self, rank: int, stream: str, block: str) -> None:
        """Queue a block of lines; never blocks (drops and counts when the queue is full)."""
        count = block_lines(block)
        with self._queue_ready:
            if self._queued_lines + count > self.QUEUE_LINES:
                self._dropped += count
                return
            self._queued_lines += count
            self._queue.append((rank, stream, block, count))
            self._queue_ready.notify()

    def rank_event(self, rank: int, state: str) -> None:
        """Queue a rank's state change for the driver's live status (never blocks)."""
        with self._queue_ready:
            self._queue.append((rank, EVENT_STREAM, state, 0))
            self._queue_ready.notify()

    def rendezvous(self, hello: dict[str, Any], stop: threading.Event) -> list[dict[str, Any]] | None:
        """Say ``hello`` (with this node's ``node`` number) to the driver and wait for every node's
        hello, in node order; None if ``stop`` is set first (the driver stopped the run).

        This replaces a Spark barrier ``allGather`` round, which costs about a second.
        """
        with self._queue_ready:
            self._hello = {**hello, "node": self._node}
            self._queue.append((self._node, HELLO_STREAM, "", 0))
            self._queue_ready.notify()
        while not self._peers_ready.wait(0.2):
            if stop.is_set():
                return None
        return self._peers

    def _connect(self) -> socket.socket:
        sock = socket.create_connection(self._address, timeout=HANDSHAKE_SECONDS)
        nonce = _recv_exact(sock, NONCE_BYTES)
        sock.sendall(_digest(self._secret, nonce))
        if _recv_exact(sock, len(_OK)) != _OK:
            raise ConnectionError("handshake refused")
        sock.settimeout(None)
        with self._acks:
            self._sock_alive = True
        threading.Thread(target=self._read_loop, args=(sock,), name="spark-torch-log-control", daemon=True).start()
        return sock

    def _read_loop(self, sock: socket.socket) -> None:
        try:
            while True:
                message = _recv_frame(sock)
                if "stop" in message:
                    self._on_stop(str(message["stop"]))
                elif "peers" in message:
                    peers = message["peers"]
                    if isinstance(peers, list) and all(isinstance(p, dict) for p in peers):
                        self._peers = peers
                        self._peers_ready.set()
                elif "ack" in message:
                    acked = int(message["ack"])
                    with self._acks:
                        self._unacked = [f for f in self._unacked if f[0] > acked]
                        self._acks.notify_all()
        except (ConnectionError, OSError, ValueError):
            pass
        with self._acks:
            if self._sock is sock:
                self._sock_alive = False
            self._acks.notify_all()

    def _numbered(self, message: dict[str, Any]) -> tuple[int, bytes] | None:
        """Encode ``message`` with the next sequence number; None (no number used) if too large."""
        try:
            body = _encode({**message, "seq": self._seq + 1, "node": self._node})
        except FrameTooLarge:
            return None
        self._seq += 1
        return self._seq, body

    def _frames_of(self, entries: list[list[Any]]) -> list[tuple[int, bytes]]:
        """Encode ``entries`` as one frame, or split them until every part fits MAX_FRAME."""
        frame = self._numbered({"lines": entries})
        if frame is not None:
            return [frame]
        if len(entries) > 1:
            half = len(entries) // 2
            return self._frames_of(entries[:half]) + self._frames_of(entries[half:])
        rank, stream, block = entries[0]
        middle = block.rfind("\n", 0, len(block) // 2)
        if middle < 0:
            middle = block.find("\n", len(block) // 2)
        if middle < 0:  # cannot happen: a line is at most 64 Ki characters
            raise FrameTooLarge("a single log line does not fit a frame")
        return self._frames_of([[rank, stream, block[:middle]]]) + self._frames_of([[rank, stream, block[middle + 1 :]]])

    def _control(self, message: dict[str, Any]) -> tuple[int, bytes]:
        frame = self._numbered(message)
        assert frame is not None, "a control message always fits a frame"
        return frame

    def _next_frames(self) -> tuple[list[tuple[int, bytes]], bool]:
        """Block for queued output, then pack what is queued (about FRAME_TEXT_BYTES) into frames.

        Returns the frames and whether the last one is the end-of-stream marker.
        """
        entries: list[list[Any]] = []
        eof = False
        hello = False
        size = 0
        with self._queue_ready:
            while not self._queue and not self._dropped:
                self._queue_ready.wait()
            dropped, self._dropped = self._dropped, 0
            while self._queue and size < self.FRAME_TEXT_BYTES:
                item = self._queue.popleft()
                if item is None:
                    eof = True
                    break
                rank, stream, payload, count = item
                if stream == HELLO_STREAM:
                    hello = True
                    continue
                self._queued_lines -= count
                if stream != EVENT_STREAM:
                    size += len(payload)
                entries.append([rank, stream, payload])
        frames: list[tuple[int, bytes]] = []
        if hello and self._hello is not None:
            frames.append(self._control({"hello": self._hello}))
        if dropped:
            frames.append(self._control({"dropped": dropped, "rank": -1}))
        if entries:
            frames += self._frames_of(entries)
        if eof:
            frames.append(self._control({"eof": self._node}))
        return frames, eof

    def _send_loop(self) -> None:
        backoff = 0.05
        eof_sent = False
        while True:
            try:
                if self._sock is None or not self._sock_alive:
                    if self._sock is not None:
                        self._sock.close()
                    # connect before the first line: the driver's stop must reach silent nodes too
                    self._sock = self._connect()
                    backoff = 0.05
                    with self._acks:
                        resend = list(self._unacked)
                    for _seq, body in resend:
                        _send_body(self._sock, body)
                    if self._hello is not None and not self._peers_ready.is_set():
                        _send_frame(self._sock, {"hello": self._hello})  # the reply may have been lost
                with self._acks:
                    if eof_sent and not self._unacked:
                        return
                    if eof_sent or len(self._unacked) >= self.WINDOW:
                        self._acks.wait(0.5)  # until acknowledged or the connection died
                        continue
                frames, eof = self._next_frames()
                with self._acks:
                    self._unacked += frames
                eof_sent = eof_sent or eof
                for _seq, body in frames:
                    _send_body(self._sock, body)
            except (OSError, ConnectionError, ValueError):
                with self._acks:
                    self._sock_alive = False
                if self._closing.is_set():
                    return  # the driver is gone while we flush; give up
                time.sleep(backoff)  # reconnect backoff, not synchronisation
                backoff = min(backoff * 2, 2.0)

    def close(self, timeout: float = 10.0) -> None:
        """Send what is queued and an end-of-stream marker, until acknowledged; bounded by ``timeout``."""
        with self._queue_ready:
            self._queue.append(None)
            self._queue_ready.notify()
        self._sender.join(timeout)
        self._closing.set()
        with self._acks:
            self._acks.notify_all()
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
