"""Framing, authentication and encryption of the driver <-> node channel (both ends prove the
run's secret; every frame is AES-GCM encrypted and authenticated).

Handshake, all of it under one deadline::

    server -> client   MAGIC + server nonce (32 bytes)
    client -> server   client nonce (32) + HMAC-SHA256(secret, "client" + both nonces)
    server -> client   HMAC-SHA256(secret, "server" + both nonces)

Each side checks the other's proof with ``hmac.compare_digest``; a peer that does not know the
secret learns nothing but two random nonces (the driver's server runs this exchange without a
thread per peer, :mod:`spark_torch.channel.server`). Both ends then derive two per-connection
AES-256-GCM keys, one per direction::

    client->server key | server->client key = HKDF-SHA256(secret, salt=server nonce + client nonce,
                                                           info=MAGIC, length=64)

and every frame is::

    4-byte big-endian body length | AES-GCM(key of the direction, nonce, body, aad=the length) | 16-byte tag

with the 12-byte nonce ``direction (1 byte) + 3 zero bytes + seq (8 bytes, big-endian)``:
``direction`` is ``C`` (client to server) or ``S``, ``seq`` counts the frames of that direction
on this connection from 0. A key is never used for two connections (both nonces are fresh) nor
a nonce twice (``seq`` only grows). A frame that was injected, altered, replayed, reordered or
reflected fails to decrypt, and the connection is closed (the client reconnects). Only the
frame lengths travel in clear.

A body (the plaintext) is a UTF-8 JSON object, or ``"B"`` + 4-byte header length + a JSON
object + raw bytes (a message with a binary payload, e.g. a piece of rank 0's result, under the
key ``"_bytes"``; encrypted straight from the caller's buffer, the receiver gets a view of the
decrypted frame). Bodies are only ever decoded as JSON text, never unpickled.

Why not ``multiprocessing.connection``: on Python 3.11 its authkey challenge is HMAC-MD5, it
authenticates only the handshake (no per-frame integrity or secrecy), and its ``recv()``
unpickles.
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

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

__all__ = [
    "MAX_FRAME",
    "BINARY_HEADER_ROOM",
    "Body",
    "body_size",
    "Keys",
    "Link",
    "ServerChallenge",
    "AuthenticationError",
    "ProtocolError",
    "FrameTooLarge",
    "encode",
    "sendable",
    "client_handshake",
    "tune_socket",
]

MAGIC = b"spark-torch-channel-3\n"
NONCE_BYTES = 32
#: a handshake proof (HMAC-SHA256)
PROOF_BYTES = hashlib.sha256().digest_size
#: what the client answers the greeting with: its nonce and its proof
ANSWER_BYTES = NONCE_BYTES + PROOF_BYTES
#: the AES-GCM tag after every frame's ciphertext
TAG_BYTES = 16
KEY_BYTES = 32
#: largest frame body
MAX_FRAME = 1024 * 1024
_LENGTH = struct.Struct(">I")
#: AES-GCM nonce: direction byte, 3 zero bytes, frame sequence number
_NONCE = struct.Struct(">c3xQ")

#: the two keys of a connection: (client -> server, server -> client)
Keys = tuple[bytes, bytes]


class AuthenticationError(ConnectionError):
    """The peer did not prove the run's secret (handshake), or a frame failed to decrypt."""


class ProtocolError(ConnectionError):
    """The peer sent something that is not a valid frame (too large, not a JSON object)."""


class FrameTooLarge(ValueError):
    """A message that would exceed :data:`MAX_FRAME` once encoded."""


def _proof(secret: bytes, label: bytes, nonces: bytes) -> bytes:
    return hmac.new(secret, label + nonces, hashlib.sha256).digest()


def _derive_keys(secret: bytes, nonces: bytes) -> Keys:
    material = HKDF(algorithm=hashes.SHA256(), length=2 * KEY_BYTES, salt=nonces, info=MAGIC).derive(secret)
    return material[:KEY_BYTES], material[KEY_BYTES:]


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


class ServerChallenge:
    """The driver's side of the handshake as data, so that a server can run it without blocking
    (and without a thread) per peer: send :attr:`greeting`, read :data:`ANSWER_BYTES`, then
    :meth:`check` them."""

    def __init__(self, secret: bytes) -> None:
        self._secret = secret
        self._nonce = os.urandom(NONCE_BYTES)
        self.greeting = MAGIC + self._nonce

    def check(self, answer: bytes) -> tuple[bytes, Keys]:
        """The client's answer; returns our proof (to send) and the connection's keys. Raises
        :class:`AuthenticationError` when the client did not prove the secret."""
        if len(answer) != ANSWER_BYTES:
            raise AuthenticationError("the peer's answer has the wrong size")
        nonces = self._nonce + bytes(answer[:NONCE_BYTES])
        if not hmac.compare_digest(bytes(answer[NONCE_BYTES:]), _proof(self._secret, b"client", nonces)):
            raise AuthenticationError("the peer did not prove the run's secret")
        return _proof(self._secret, b"server", nonces), _derive_keys(self._secret, nonces)


def client_handshake(sock: socket.socket, secret: bytes, deadline: float, idle_timeout: float | None) -> Link:
    """Node side: answer the driver's challenge and check that the driver knows the secret too."""
    greeting = _recv_exact(sock, len(MAGIC) + NONCE_BYTES, deadline)
    if not greeting.startswith(MAGIC):
        raise AuthenticationError("the peer is not a spark_torch driver channel (or another version)")
    server_nonce = bytes(greeting[len(MAGIC) :])
    client_nonce = os.urandom(NONCE_BYTES)
    nonces = server_nonce + client_nonce
    _send_before(sock, client_nonce + _proof(secret, b"client", nonces), deadline)
    proof = _recv_exact(sock, PROOF_BYTES, deadline)
    if not hmac.compare_digest(bytes(proof), _proof(secret, b"server", nonces)):
        raise AuthenticationError("the driver's channel did not prove the run's secret")
    return Link(sock, _derive_keys(secret, nonces), server=False, idle_timeout=idle_timeout)


#: first byte of a body that carries a binary payload after its JSON header
BINARY = b"B"
#: room for a binary message's header next to its payload
BINARY_HEADER_ROOM = 256


#: an encoded frame body: bytes, or parts sent one after the other (a binary message's header
#: and its payload, which is then encrypted straight from the caller's buffer)
Body = bytes | tuple[bytes, memoryview]


def body_size(body: Body) -> int:
    """Bytes of an encoded body."""
    return len(body) if isinstance(body, bytes) else len(body[0]) + body[1].nbytes


def encode(message: dict[str, Any]) -> Body:
    """A message as a frame body; raises :class:`FrameTooLarge` beyond :data:`MAX_FRAME`, and
    ``ValueError``/``TypeError`` for what JSON or UTF-8 cannot carry (e.g. a lone surrogate).

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


def sendable(text: str) -> tuple[str, int]:
    """``text`` as the channel can carry it (a lone surrogate, which UTF-8 cannot encode, is
    shown as ``\\udcXX``) and its size in UTF-8 bytes."""
    if text.isascii():
        return text, len(text)
    try:
        return text, len(text.encode("utf-8"))
    except UnicodeEncodeError:
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
        return text, len(text.encode("utf-8"))


class Link:
    """One authenticated, encrypted connection. ``send`` is thread-safe; one thread calls ``recv``.

    ``idle_timeout`` bounds every socket operation: a peer that sends nothing at all (not even a
    heartbeat) for that long, or does not take our bytes for that long, ends the connection.
    """

    def __init__(self, sock: socket.socket, keys: Keys, *, server: bool, idle_timeout: float | None) -> None:
        self.sock = sock
        client_key, server_key = keys
        self._out_key, in_key = (server_key, client_key) if server else (client_key, server_key)
        self._seal = AESGCM(self._out_key)
        self._open = AESGCM(in_key)
        self._out_direction, self._in_direction = (b"S", b"C") if server else (b"C", b"S")
        self._out_seq = 0
        self._in_seq = 0
        self._send_lock = threading.Lock()
        sock.settimeout(idle_timeout)

    def send_body(self, body: Body) -> None:
        """Send one encoded body (see :func:`encode`) as an encrypted, authenticated frame."""
        size = body_size(body)
        frame = bytearray(_LENGTH.size + size + TAG_BYTES)
        _LENGTH.pack_into(frame, 0, size)
        length = bytes(frame[: _LENGTH.size])
        sealed = memoryview(frame)[_LENGTH.size :]
        with self._send_lock:  # the nonce's seq must follow the order frames go out in
            nonce = _NONCE.pack(self._out_direction, self._out_seq)
            if isinstance(body, bytes):
                self._seal.encrypt_into(nonce, body, length, sealed)
            else:  # header and payload in one pass, without joining them first
                encryptor = Cipher(algorithms.AES(self._out_key), modes.GCM(nonce)).encryptor()
                encryptor.authenticate_additional_data(length)
                done = 0
                for part in body:
                    done += encryptor.update_into(part, sealed[done:])
                encryptor.finalize()
                sealed[size:] = encryptor.tag
            self._out_seq += 1
            self.sock.sendall(frame)

    def send(self, message: dict[str, Any]) -> None:
        """Send one message."""
        self.send_body(encode(message))

    def recv(self) -> dict[str, Any]:
        """The next message. Raises ``TimeoutError`` when nothing at all arrives within the idle
        timeout, :class:`AuthenticationError` for a frame that fails to decrypt,
        :class:`ProtocolError` for one that is too large or not a JSON object."""
        header = _recv_exact(self.sock, _LENGTH.size, None)
        (size,) = _LENGTH.unpack(header)
        if size > MAX_FRAME:
            raise ProtocolError(f"a frame of {size} bytes exceeds the {MAX_FRAME} byte limit")
        # the rest of a frame that started must follow promptly
        sealed = _recv_exact(self.sock, size + TAG_BYTES, None)
        plain = bytearray(size)
        try:
            self._open.decrypt_into(_NONCE.pack(self._in_direction, self._in_seq), sealed, bytes(header), plain)
        except InvalidTag:
            raise AuthenticationError(
                "a frame failed to decrypt (altered, injected, replayed, reordered or reflected)"
            ) from None
        self._in_seq += 1
        body = memoryview(plain)
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
