"""Shared by the channel tests: sinks that record (lines, report() steps, bulk bytes), a driver
end on loopback, a node spec that goes through a proxy, the exact bytes of a frame, and a
polling wait with a deadline."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

from spark_torch.channel import wire
from spark_torch.channel.driver_end import DriverChannel, new_secret
from spark_torch.shared.spec import ChannelSpec

from ..netproxy import Proxy


class Lines:
    """A line sink that keeps every (rank, stream, line) it receives."""

    def __init__(self) -> None:
        self.items: list[tuple[int, str, str]] = []
        self.lock = threading.Lock()

    def __call__(self, rank: int, stream: str, block: str) -> None:
        with self.lock:
            self.items.extend((rank, stream, text) for text in block.split("\n"))

    def flush(self) -> None:
        pass

    def rank_event(self, rank: int, state: str) -> None:
        pass

    def texts(self) -> list[str]:
        with self.lock:
            return [t for _, _, t in self.items]


class Reports:
    """A report() sink on the driver: keeps what the nodes reported."""

    last_answer: tuple[int, str | None] | None = None

    def __init__(self) -> None:
        self.got: list[Any] = []

    def node_report(self, node: int, report: Any) -> None:
        self.got.append(report)


class Bulk:
    """A bulk sink on the driver: keeps the bytes."""

    def __init__(self) -> None:
        self.data = bytearray()

    def piece(self, node: int, header: Any, data: Any) -> None:
        self.data += data


def wait_for(what: str, done: Any, seconds: float = 10.0) -> None:
    """Poll ``done()`` every 10 ms; fail naming ``what`` after ``seconds``."""
    deadline = time.monotonic() + seconds
    while not done():
        assert time.monotonic() < deadline, f"timed out after {seconds}s waiting for {what}"
        time.sleep(0.01)


def driver_channel(nodes: int = 1, **kwargs: Any) -> tuple[DriverChannel, Lines]:
    """A DriverChannel on 127.0.0.1 for ``nodes`` nodes with a fresh secret, and its sink."""
    lines = Lines()
    kwargs.setdefault("advertise_host", "127.0.0.1")
    channel = DriverChannel(lines, nodes=nodes, bind_host="127.0.0.1", secret=new_secret(), **kwargs)
    return channel, lines


def rendezvous_all(nodes: list[Any], timeout: float = 20.0) -> dict[int, Any]:
    """Every NodeChannel's rendezvous at once (one thread each, node n says port n)."""
    results: dict[int, Any] = {}
    threads = [
        threading.Thread(target=lambda n=n: results.__setitem__(n, nodes[n].rendezvous({"port": 1000 + n})))
        for n in range(len(nodes))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    return results


def through(proxy: Proxy, spec: ChannelSpec) -> ChannelSpec:
    """The spec a node gets when the driver advertises the proxy."""
    proxy.target = (spec.host, spec.port)
    return ChannelSpec(
        host="127.0.0.1",
        port=proxy.port,
        secret=spec.secret,
        heartbeat=spec.heartbeat,
        rendezvous_timeout=spec.rendezvous_timeout,
    )


def sealed_frame(link: wire.Link, message: dict[str, Any]) -> bytes:
    """The exact bytes ``link`` would put on the wire for ``message`` next (its seq advances),
    captured from a socketpair."""
    real = link.sock
    capture, sink = socket.socketpair()
    link.sock = capture
    try:
        link.send(message)
        return sink.recv(4 + wire.body_size(wire.encode(message)) + wire.TAG_BYTES)
    finally:
        link.sock = real
        capture.close()
        sink.close()


def serve_handshake(
    sock: socket.socket, secret: bytes, idle_timeout: float | None = 5.0, seconds: float = 5.0
) -> wire.Link:
    """The driver's side of the handshake on one socket, blocking: what channel/server.py does
    for each peer without blocking (a :class:`wire.ServerChallenge`'s greeting, the peer's answer
    checked, our proof), bounded by ``seconds``."""
    challenge = wire.ServerChallenge(secret)
    sock.settimeout(seconds)
    sock.sendall(challenge.greeting)
    answer = b""
    while len(answer) < wire.ANSWER_BYTES:
        chunk = sock.recv(wire.ANSWER_BYTES - len(answer))
        if not chunk:
            raise ConnectionError("the peer closed the connection during the handshake")
        answer += chunk
    proof, keys = challenge.check(answer)
    sock.sendall(proof)
    return wire.Link(sock, keys, server=True, idle_timeout=idle_timeout)
