"""Framing and authentication of the driver <-> node channel (both ends prove the run's secret).

Handshake, all of it under one deadline::

    server -> client   MAGIC + server nonce (32 bytes)
    client -> server   client nonce (32) + HMAC(secret, "client" + both nonces)
    server -> client   HMAC(secret, "server" + both nonces)

Each side checks the other's proof with ``hmac.compare_digest``; a peer that does not know the
secret learns nothing but two random nonces. Both ends then derive a per-connection key,
``HMAC(secret, "session" + both nonces)``, and every frame is::

    4-byte big-endian body length | body | HMAC(key, direction + seq + body)

A body is a UTF-8 JSON object, or ``"B"`` + 4-byte header length + a JSON object + raw bytes
(a message with a binary payload, e.g. a piece of rank 0's result, under the key ``"_bytes"``).

``direction`` is ``C`` (client to server) or ``S``; ``seq`` counts the frames of that direction
on this connection (8 bytes, big-endian, from 0). A frame that was injected, altered, replayed,
reordered or reflected fails its MAC, and the connection is closed (the client reconnects).
Bodies are only ever decoded as JSON text, never unpickled.

Why not ``multiprocessing.connection``: on Python 3.11 its authkey challenge is HMAC-MD5, it
authenticates only the handshake (no per-frame integrity), and its ``recv()`` unpickles.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
import struct
import threading
import time
from typing import Any

__all__ = [
    "MAX_FRAME",
    "BINARY_HEADER_ROOM",
    "Body",
    "body_size",
    "Link",
    "AuthenticationError",
    "ProtocolError",
    "FrameTooLarge",
    "encode",
    "client_handshake",
    "server_handshake",
    "tune_socket",
]

MAGIC = b"spark-torch-channel-2\n"
NONCE_BYTES = 32
MAC_BYTES = hashlib.sha256().digest_size
#: largest frame body
MAX_FRAME = 1024 * 1024
_LENGTH = struct.Struct(">I")
_SEQ = struct.Struct(">Q")


class AuthenticationError(ConnectionError):
    """The peer did not prove the run's secret (handshake), or a frame failed its MAC."""


class ProtocolError(ConnectionError):
    """The peer sent something that is not a valid frame (too large, not a JSON object)."""


class FrameTooLarge(ValueError):
    """A message that would exceed :data:`MAX_FRAME` once encoded."""


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, size: int, deadline: float | None) -> bytearray:
    """Exactly ``size`` bytes, read in place; ``deadline`` (monotonic) bounds the whole read,
    not each recv."""
    data = bytearray(size)
    view = memoryview(data)
    got = 0
    while got < size:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"timed out waiting for {size - got} more byte(s)")
            sock.settimeout(remaining)
        count = sock.recv_into(view[got:])
        if not count:
            raise ConnectionError("connection closed by the peer")
        got += count
    return data


def _send_before(sock: socket.socket, data: bytes, deadline: float) -> None:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError("timed out during the handshake")
    sock.settimeout(remaining)
    sock.sendall(data)


def tune_socket(sock: socket.socket, idle_seconds: float) -> None:
    """TCP keepalive (and, on Linux, a bound on unacknowledged writes) so that a connection a
    firewall or NAT dropped silently is noticed within seconds, not after TCP's ~15 minutes."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    idle = max(1, int(idle_seconds))
    for name, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", max(1, idle // 2)), ("TCP_KEEPCNT", 3)):
        option = getattr(socket, name, None)
        if option is not None:
            sock.setsockopt(socket.IPPROTO_TCP, option, value)
    user_timeout = getattr(socket, "TCP_USER_TIMEOUT", None)
    if user_timeout is not None:
        sock.setsockopt(socket.IPPROTO_TCP, user_timeout, int(idle * 3 * 1000))


def server_handshake(sock: socket.socket, secret: bytes, deadline: float, idle_timeout: float | None) -> Link:
    """Driver side: challenge the peer, check its proof, prove ourselves. Bounded by ``deadline``."""
    server_nonce = os.urandom(NONCE_BYTES)
    _send_before(sock, MAGIC + server_nonce, deadline)
    answer = _recv_exact(sock, NONCE_BYTES + MAC_BYTES, deadline)
    client_nonce, proof = bytes(answer[:NONCE_BYTES]), bytes(answer[NONCE_BYTES:])
    nonces = server_nonce + client_nonce
    if not hmac.compare_digest(proof, _mac(secret, b"client", nonces)):
        raise AuthenticationError("the peer did not prove the run's secret")
    _send_before(sock, _mac(secret, b"server", nonces), deadline)
    return Link(sock, _mac(secret, b"session", nonces), server=True, idle_timeout=idle_timeout)


def client_handshake(sock: socket.socket, secret: bytes, deadline: float, idle_timeout: float | None) -> Link:
    """Node side: answer the driver's challenge and check that the driver knows the secret too."""
    greeting = _recv_exact(sock, len(MAGIC) + NONCE_BYTES, deadline)
    if not greeting.startswith(MAGIC):
        raise AuthenticationError("the peer is not a spark_torch driver channel (or another version)")
    server_nonce = bytes(greeting[len(MAGIC) :])
    client_nonce = os.urandom(NONCE_BYTES)
    nonces = server_nonce + client_nonce
    _send_before(sock, client_nonce + _mac(secret, b"client", nonces), deadline)
    proof = _recv_exact(sock, MAC_BYTES, deadline)
    if not hmac.compare_digest(proof, _mac(secret, b"server", nonces)):
        raise AuthenticationError("the driver's channel did not prove the run's secret")
    return Link(sock, _mac(secret, b"session", nonces), server=False, idle_timeout=idle_timeout)


#: first byte of a body that carries a binary payload after its JSON header
BINARY = b"B"
#: room for a binary message's header next to its payload
BINARY_HEADER_ROOM = 256


#: an encoded frame body: bytes, or parts sent one after the other (a binary message's header
#: and its payload, which is then never copied in user space)
Body = bytes | tuple[bytes, memoryview]


def body_size(body: Body) -> int:
    """Bytes of an encoded body."""
    return len(body) if isinstance(body, bytes) else len(body[0]) + body[1].nbytes


def encode(message: dict[str, Any]) -> Body:
    """A message as a frame body; raises :class:`FrameTooLarge` beyond :data:`MAX_FRAME`.

    A ``"_bytes"`` item (bytes-like) travels raw after the JSON header, not inside the JSON.
    """
    payload = message.get("_bytes")
    body: Body
    if payload is not None:
        header = json.dumps({k: v for k, v in message.items() if k != "_bytes"}, separators=(",", ":")).encode("utf-8")
        body = (BINARY + _LENGTH.pack(len(header)) + header, memoryview(payload).cast("B"))
    else:
        body = json.dumps(message, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    if body_size(body) > MAX_FRAME:
        raise FrameTooLarge(f"a frame of {body_size(body)} bytes exceeds the {MAX_FRAME} byte limit")
    return body


def _sendall(sock: socket.socket, parts: list[bytes | memoryview]) -> None:
    """``sendall`` of several buffers with scatter-gather I/O (no joining copy)."""
    views = [memoryview(p).cast("B") for p in parts]
    while views:
        sent = sock.sendmsg(views)
        while views and sent >= views[0].nbytes:
            sent -= views[0].nbytes
            views.pop(0)
        if views and sent:
            views[0] = views[0][sent:]


class Link:
    """One authenticated connection. ``send`` is thread-safe; one thread calls ``recv``.

    ``idle_timeout`` bounds every socket operation: a peer that sends nothing at all (not even a
    heartbeat) for that long, or does not take our bytes for that long, ends the connection.
    """

    def __init__(self, sock: socket.socket, key: bytes, *, server: bool, idle_timeout: float | None) -> None:
        self.sock = sock
        self._key = key
        self._out_direction, self._in_direction = (b"S", b"C") if server else (b"C", b"S")
        self._out_seq = 0
        self._in_seq = 0
        self._send_lock = threading.Lock()
        sock.settimeout(idle_timeout)

    def send_body(self, body: Body) -> None:
        """Send one encoded body (see :func:`encode`) as an authenticated frame."""
        parts: list[bytes | memoryview] = [body] if isinstance(body, bytes) else [body[0], body[1]]
        with self._send_lock:
            digest = hmac.new(self._key, self._out_direction + _SEQ.pack(self._out_seq), hashlib.sha256)
            for part in parts:
                digest.update(part)
            self._out_seq += 1
            _sendall(self.sock, [_LENGTH.pack(body_size(body)), *parts, digest.digest()])

    def send(self, message: dict[str, Any]) -> None:
        """Send one message."""
        self.send_body(encode(message))

    def recv(self) -> dict[str, Any]:
        """The next message. Raises ``TimeoutError`` when nothing at all arrives within the idle
        timeout, :class:`AuthenticationError` for a frame that fails its MAC,
        :class:`ProtocolError` for one that is too large or not a JSON object."""
        header = _recv_exact(self.sock, _LENGTH.size, None)
        (size,) = _LENGTH.unpack(header)
        if size > MAX_FRAME:
            raise ProtocolError(f"a frame of {size} bytes exceeds the {MAX_FRAME} byte limit")
        # the rest of a frame that started must follow promptly
        rest = memoryview(_recv_exact(self.sock, size + MAC_BYTES, None))
        body, mac = rest[:size], rest[size:]
        digest = hmac.new(self._key, self._in_direction + _SEQ.pack(self._in_seq), hashlib.sha256)
        digest.update(body)
        if not hmac.compare_digest(bytes(mac), digest.digest()):
            raise AuthenticationError("a frame failed its authentication check (altered, injected or replayed)")
        self._in_seq += 1
        payload = None
        if body[:1] == BINARY:
            if len(body) < 1 + _LENGTH.size:
                raise ProtocolError("a binary frame without its header")
            (header_size,) = _LENGTH.unpack(body[1 : 1 + _LENGTH.size])
            start = 1 + _LENGTH.size
            if start + header_size > len(body):
                raise ProtocolError("a binary frame's header runs past its end")
            payload = body[start + header_size :]  # a view: no copy of the data
            body = body[start : start + header_size]
        try:
            message = json.loads(bytes(body).decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise ProtocolError(f"a frame is not valid JSON ({type(exc).__name__})") from None
        if not isinstance(message, dict):
            raise ProtocolError("a frame is not a JSON object")
        if payload is not None:
            message["_bytes"] = payload
        return message

    def close(self) -> None:
        """Shut the connection down (wakes a thread blocked in ``recv``) and close it."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
