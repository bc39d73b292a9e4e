"""A small TCP proxy on loopback that misbehaves on purpose, for testing the channel.

``Proxy(target)`` forwards every accepted connection to ``target``. Faults, each applied to the
first ``faulty`` connections only (later ones pass through, so a client that reconnects gets
through):

- ``cut_after``: close both sides once this many bytes went through the connection;
- ``idle_cut``: close both sides when no byte moved either way for this many seconds (what a
  cloud load balancer or NAT does to an idle connection);
- ``blackhole_after``: after this many bytes, stop forwarding but keep both sides open (a
  silent drop: nothing arrives, nobody is told);
- ``corrupt_at``: flip one bit of the byte at this offset of what the client sends (an active
  attacker, or a broken middlebox);
- ``answer_delay``: hold the client's first bytes this many seconds (a node slow to answer the
  driver's handshake: a loaded executor, a long round trip).

``record=True`` keeps every byte forwarded (``recorded``: all connections, both directions), for
tests of what a passive observer of the network sees.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass, field


@dataclass
class _Pair:
    client: socket.socket
    server: socket.socket
    faulty: bool
    moved: int = 0
    last: float = field(default_factory=time.monotonic)
    closed: bool = False
    blackholed: bool = False
    #: bytes the client sent so far (for ``corrupt_at``)
    upstream: int = 0


class Proxy:
    def __init__(
        self,
        target: tuple[str, int] | None = None,
        *,
        cut_after: int | None = None,
        idle_cut: float | None = None,
        blackhole_after: int | None = None,
        corrupt_at: int | None = None,
        answer_delay: float | None = None,
        faulty: int = 1,
        record: bool = False,
    ) -> None:
        self.target = target
        self.cut_after = cut_after
        self.idle_cut = idle_cut
        self.blackhole_after = blackhole_after
        self.corrupt_at = corrupt_at
        self.answer_delay = answer_delay
        self.faulty_left = faulty
        self.record = record
        #: every byte forwarded (``record=True``), in the order the proxy forwarded it
        self.recorded = bytearray()
        self.connections = 0
        self.cuts = 0
        self._lock = threading.Lock()
        self._pairs: list[_Pair] = []
        self._threads: list[threading.Thread] = []
        self._closed = threading.Event()
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(16)
        self.port = self._listener.getsockname()[1]
        self._start(self._accept_loop)
        if idle_cut is not None:
            self._start(self._idle_watch)

    def _start(self, target: object, *args: object) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)  # type: ignore[arg-type]
        self._threads.append(thread)
        thread.start()

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            assert self.target is not None, "set proxy.target before clients connect"
            try:
                server = socket.create_connection(self.target, timeout=5)
                server.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                self.connections += 1
                faulty = self.faulty_left > 0
                self.faulty_left -= int(faulty)
                pair = _Pair(client, server, faulty)
                self._pairs.append(pair)
            self._start(self._pump, pair, client, server)
            self._start(self._pump, pair, server, client)

    def _cut(self, pair: _Pair) -> None:
        """A fault: close both sides (counted)."""
        self._close(pair, fault=True)

    def _close_quietly(self, pair: _Pair) -> None:
        """One side closed or failed: close the other (not a fault of ours)."""
        self._close(pair, fault=False)

    def _close(self, pair: _Pair, fault: bool) -> None:
        with self._lock:
            if pair.closed:
                return
            pair.closed = True
            self.cuts += int(fault)
        for sock in (pair.client, pair.server):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    def _pump(self, pair: _Pair, source: socket.socket, sink: socket.socket) -> None:
        while True:
            try:
                data = source.recv(65536)
            except OSError:
                data = b""
            if not data:  # one side closed: pass that on (not a fault of ours)
                self._close_quietly(pair)
                return
            with self._lock:
                pair.moved += len(data)
                pair.last = time.monotonic()
                moved = pair.moved
                if self.record:
                    self.recorded += data
            if source is pair.client:
                if pair.faulty and self.answer_delay is not None and pair.upstream == 0:
                    time.sleep(self.answer_delay)  # the slowness being simulated, not a synchronisation
                offset = pair.upstream
                pair.upstream += len(data)
                if pair.faulty and self.corrupt_at is not None and offset <= self.corrupt_at < pair.upstream:
                    flipped = bytearray(data)
                    flipped[self.corrupt_at - offset] ^= 0x01
                    data = bytes(flipped)
            if pair.faulty and self.blackhole_after is not None and moved > self.blackhole_after:
                pair.blackholed = True
            if pair.blackholed:
                continue  # swallowed: the peer hears nothing and is told nothing
            try:
                sink.sendall(data)
            except OSError:
                self._close_quietly(pair)
                return
            if pair.faulty and self.cut_after is not None and moved > self.cut_after:
                self._cut(pair)
                return

    def _idle_watch(self) -> None:
        assert self.idle_cut is not None
        while not self._closed.wait(0.05):
            now = time.monotonic()
            with self._lock:
                idle = [p for p in self._pairs if p.faulty and not p.closed and now - p.last > self.idle_cut]
            for pair in idle:
                self._cut(pair)

    def close(self) -> None:
        self._closed.set()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            pairs = list(self._pairs)
        for pair in pairs:
            self._close_quietly(pair)
        for thread in self._threads:
            thread.join(5)
