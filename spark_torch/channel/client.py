"""The node end of the reliable channel (:mod:`spark_torch.channel.transport`): keeps one
authenticated connection to the driver up, numbers and resends messages until acknowledged,
sends heartbeats when quiet, and reconnects with jittered backoff.

A message is numbered and encoded when it is queued, so one that cannot be sent (too large, not
JSON, not UTF-8) raises at the caller and nothing queued is lost with it."""

from __future__ import annotations

import random
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from spark_torch.channel.transport import (
    BACKOFF_MAX,
    BACKOFF_MIN,
    BUSY_BACKOFF_MAX,
    DEAD_AFTER,
    HANDSHAKE_SECONDS,
    JOIN_SECONDS,
    WINDOW,
)
from spark_torch.channel.wire import Body, Link, client_handshake, encode, tune_socket

__all__ = ["ChannelClient", "Outbox", "Frame", "Numbering"]

#: a numbered, encoded message: (sequence number, frame body)
Frame = tuple[int, Body]
#: numbers and encodes one message; raises FrameTooLarge/ValueError/TypeError without using a number
Numbering = Callable[[dict[str, Any]], Frame]


class Outbox(Protocol):
    """Where a :class:`ChannelClient` takes the bulk of its messages from (called under ``cond``)."""

    def pending(self) -> bool:
        """Whether :meth:`take` would return something."""

    def take(self, number: Numbering) -> list[Frame]:
        """The next messages, each numbered and encoded with ``number`` (in order); a message
        ``number`` refuses must be split or replaced, never lost silently."""


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
        self._control: deque[Frame] = deque()
        self._unacked: list[Frame] = []
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
        #: the last connection was closed by the driver during the handshake (it is busy)
        self._refused = False
        self._sender = threading.Thread(target=self._send_loop, name="spark-torch-channel-client", daemon=True)
        self._sender.start()

    @property
    def address(self) -> str:
        """``host:port`` of the driver's channel, for messages."""
        host, port = self._address
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def send(
        self,
        message: dict[str, Any],
        *,
        block_until: float | None = None,
        abort: Callable[[], str | None] | None = None,
    ) -> None:
        """Queue a control message (delivered once, in order, before queued outbox messages).

        The message is encoded now: one that cannot be sent raises
        :class:`~spark_torch.channel.wire.FrameTooLarge` or ``ValueError``/``TypeError`` here,
        and nothing is queued. With ``block_until`` (a monotonic deadline) wait first until fewer
        than ``WINDOW`` messages are queued or unacknowledged (bulk data: memory stays bounded);
        raises ``TimeoutError`` at the deadline and ``ConnectionError`` when the client closes
        or ``abort`` (checked under :attr:`cond`) returns a reason.
        """
        with self.cond:
            if block_until is not None:
                while True:
                    reason = abort() if abort is not None else None
                    if reason is not None:
                        raise ConnectionError(reason)
                    if len(self._control) + len(self._unacked) < WINDOW:
                        break
                    if self._closing.is_set():
                        raise ConnectionError("the channel client is closing")
                    remaining = block_until - time.monotonic()
                    if remaining <= 0:
                        raise TimeoutError(f"the driver at {self.address} took no data for too long")
                    self.cond.wait(min(remaining, 0.5))
            self._control.append(self._number(message))
            self.cond.notify_all()

    def idle(self) -> bool:
        """Nothing queued and everything sent was acknowledged (call under :attr:`cond`)."""
        return not self._control and not self._unacked and not (self._outbox is not None and self._outbox.pending())

    def _connect(self) -> Link:
        self._refused = False
        sock = socket.create_connection(self._address, timeout=HANDSHAKE_SECONDS)
        with self.cond:
            self._connecting = sock  # close() shuts it down instead of waiting out the handshake
        if self._closing.is_set():
            sock.close()
            raise ConnectionError("closing")
        try:
            tune_socket(sock, self._heartbeat)
            link = client_handshake(
                sock, self._secret, time.monotonic() + HANDSHAKE_SECONDS, self._heartbeat * DEAD_AFTER
            )
            link.send({"attach": self._node})
        except BaseException as exc:
            sock.close()
            self._refused = isinstance(exc, ConnectionError)  # closed by a driver whose handshake slots are full
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

    def _number(self, message: dict[str, Any]) -> Frame:
        """Number and encode (under cond); a message that cannot be encoded uses no number."""
        body = encode({**message, "seq": self._seq + 1})
        self._seq += 1
        return self._seq, body

    def _next_frames(self, last_sent: float) -> tuple[list[Frame], bool]:
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
            # control frames were numbered when queued, before anything the outbox numbers now
            frames = list(self._control)
            self._control.clear()
            if window_open and self._outbox is not None:
                frames += self._outbox.take(self._number)
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
                backoff = min(backoff * 2, BUSY_BACKOFF_MAX if self._refused else BACKOFF_MAX)
        with self.cond:
            link = self._link
        if link is not None:
            link.close()

    def drain(self, timeout: float, abort: Callable[[], str | None] | None = None) -> bool:
        """Wait until everything queued was acknowledged; False on timeout (or never attached
        and no connection now), or as soon as ``abort`` (checked under :attr:`cond`) returns a
        reason."""
        with self.cond:  # every change to what idle() and abort() read notifies cond
            settled = self.cond.wait_for(lambda: self.idle() or (abort is not None and abort() is not None), timeout)
            return settled and self.idle()

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
