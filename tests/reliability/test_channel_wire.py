"""The channel's framing and authentication: both ends prove the secret; every frame is
authenticated; strangers, slow peers and malformed frames cost bounded time and threads."""

from __future__ import annotations

import json
import logging
import socket
import struct
import threading
import time
from typing import Any

import pytest

from spark_torch.channel import wire
from spark_torch.channel.driver_end import DriverChannel
from spark_torch.channel.messages import PROTOCOL
from spark_torch.channel.node_end import NodeChannel
from spark_torch.channel.transport import HANDSHAKE_SECONDS, MAX_PENDING_HANDSHAKES
from spark_torch.shared.spec import ChannelSpec

from .channel_helpers import driver_channel as _driver
from .channel_helpers import sealed_frame, serve_handshake, wait_for


def _pair(secret: bytes = b"k" * 32) -> tuple[wire.Link, wire.Link, socket.socket, socket.socket]:
    """A connected (server link, client link) over a socketpair, after the real handshake."""
    a, b = socket.socketpair()
    box: dict[str, Any] = {}

    def serve() -> None:
        box["server"] = serve_handshake(a, secret)

    thread = threading.Thread(target=serve)
    thread.start()
    client = wire.client_handshake(b, secret, time.monotonic() + 5, 5.0)
    thread.join(5)
    return box["server"], client, a, b


def test_frames_round_trip_both_ways() -> None:
    server, client, *_ = _pair()
    client.send({"hello": 1})
    assert server.recv() == {"hello": 1}
    server.send({"stop": "timeout"})
    assert client.recv() == {"stop": "timeout"}


@pytest.mark.parametrize("attack", ["altered", "injected", "replayed", "reordered", "reflected"])
def test_tampered_frames_are_rejected(attack: str) -> None:
    server, client, a, b = _pair()
    if attack == "altered":
        frame = bytearray(sealed_frame(client, {"stop": "no"}))
        frame[6] ^= 0x01
        b.sendall(bytes(frame))
    elif attack == "injected":  # a frame made without the key
        body = json.dumps({"stop": "now"}).encode()
        b.sendall(struct.pack(">I", len(body)) + body + bytes(wire.TAG_BYTES))
    elif attack == "replayed":
        frame = sealed_frame(client, {"lines": []})
        b.sendall(frame)
        assert server.recv() == {"lines": []}
        b.sendall(frame)
    elif attack == "reordered":
        first = sealed_frame(client, {"n": 1})
        second = sealed_frame(client, {"n": 2})
        b.sendall(second + first)
    elif attack == "reflected":  # a frame the server sent, played back to it
        a_frame = sealed_frame(server, {"ack": 1})
        b.sendall(a_frame)
    with pytest.raises(wire.AuthenticationError):
        server.recv()


def test_client_rejects_a_driver_that_does_not_know_the_secret() -> None:
    """Mutual authentication: a fake driver (it answers, but cannot prove the secret) is refused."""
    import os

    a, b = socket.socketpair()

    def fake_driver() -> None:
        a.sendall(wire.MAGIC + os.urandom(wire.NONCE_BYTES))
        a.recv(wire.ANSWER_BYTES)
        a.sendall(os.urandom(wire.PROOF_BYTES))

    threading.Thread(target=fake_driver, daemon=True).start()
    with pytest.raises(wire.AuthenticationError, match="did not prove"):
        wire.client_handshake(b, b"right" * 8, time.monotonic() + 5, 5.0)


def _swallow(fn: Any, *args: Any) -> None:
    try:
        fn(*args, time.monotonic() + 5, 5.0)
    except Exception:  # noqa: BLE001
        pass


def test_server_rejects_a_node_that_does_not_know_the_secret() -> None:
    a, b = socket.socketpair()
    threading.Thread(target=lambda: _swallow(wire.client_handshake, b, b"wrong" * 8), daemon=True).start()
    with pytest.raises(wire.AuthenticationError):
        serve_handshake(a, b"right" * 8)


def test_oversized_and_non_object_frames() -> None:
    server, client, a, b = _pair()
    b.sendall(struct.pack(">I", wire.MAX_FRAME + 1))
    with pytest.raises(wire.ProtocolError, match="exceeds"):
        server.recv()
    server, client, a, b = _pair()
    client.send_body(b"[1, 2]")
    with pytest.raises(wire.ProtocolError, match="not a JSON object"):
        server.recv()
    server, client, a, b = _pair()
    client.send_body(b"[" * 100_000)  # RecursionError inside json
    with pytest.raises(wire.ProtocolError, match="not valid JSON"):
        server.recv()


def _channel_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("spark-torch-channel")]


def test_slow_drip_peer_is_cut_at_the_handshake_deadline() -> None:
    """The handshake deadline covers the whole exchange, not each recv."""
    driver, _ = _driver()
    try:
        with socket.create_connection(("127.0.0.1", driver.port)) as sock:
            sock.recv(len(wire.MAGIC) + wire.NONCE_BYTES)
            start = time.monotonic()
            closed = False
            for _ in range(int(HANDSHAKE_SECONDS * 4)):
                try:
                    sock.sendall(b"x")  # one byte every 0.5 s: never a full answer
                    sock.settimeout(0.5)
                    if sock.recv(1) == b"":
                        closed = True
                        break
                except TimeoutError:
                    continue
                except OSError:
                    closed = True
                    break
            assert closed and time.monotonic() - start < HANDSHAKE_SECONDS + 2
        assert driver.rejected == 1
    finally:
        driver.close()


def test_unauthenticated_connections_are_bounded() -> None:
    driver, _ = _driver()
    socks = []
    try:
        before = len(_channel_threads())
        for _ in range(MAX_PENDING_HANDSHAKES + 8):
            socks.append(socket.create_connection(("127.0.0.1", driver.port)))
        deadline = time.monotonic() + 5
        while driver.rejected < 8 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert driver.rejected >= 8
        assert len(_channel_threads()) - before <= MAX_PENDING_HANDSHAKES
    finally:
        for sock in socks:
            sock.close()
        driver.close()


def _authenticated_raw(driver: DriverChannel, node: int = 0) -> wire.Link:
    sock = socket.create_connection(("127.0.0.1", driver.port))
    link = wire.client_handshake(sock, driver.spec.secret, time.monotonic() + 5, 5.0)
    link.send({"attach": node})
    return link


@pytest.mark.parametrize(
    "body",
    [
        b"not json",
        b"[" * 100_000,
        json.dumps({"seq": 1, "lines": [["x", "stdout", "a"]]}).encode(),
        json.dumps({"seq": 1, "lines": "nope"}).encode(),
        json.dumps({"seq": 1, "dropped": "many"}).encode(),
        json.dumps({"seq": 1, "hello": {"node": 7}}).encode(),
        json.dumps({"seq": 1, "hello": {"node": 1, "protocol": PROTOCOL + 1}}).encode(),
        json.dumps({"seq": 1, "frobnicate": {"x": 1}}).encode(),
        json.dumps({"seq": 1, "stop": "timeout"}).encode(),
        json.dumps({"seq": 2, "give_up": None, "lines": 5}).encode(),
        json.dumps({"seq": "1", "eof": 0}).encode(),
        json.dumps({"no": "seq"}).encode(),
    ],
)
def test_malformed_frames_close_the_connection_not_the_server(body: bytes) -> None:
    driver, lines = _driver(nodes=2)
    try:
        link = _authenticated_raw(driver, node=1)
        link.send_body(body)
        link.sock.settimeout(5)
        with pytest.raises(ConnectionError):  # closed by the driver (an idle timeout is not)
            while True:
                link.recv()
        # the server still serves: a real node delivers its lines
        stop = threading.Event()
        node = NodeChannel(driver.spec, 0, 2, stop)
        node(0, "stdout", "still here")
        node.close()
        assert (0, "stdout", "still here") in lines.items
    finally:
        driver.close()


def test_a_hello_of_another_protocol_version_is_refused_naming_both(caplog: pytest.LogCaptureFixture) -> None:
    """A node that speaks another version of the channel's messages (other spark_torch code): the
    driver closes its connection and says which versions differ and what to do; its other nodes
    are served."""
    driver, lines = _driver(nodes=2)
    try:
        with caplog.at_level(logging.WARNING, logger="spark_torch.channel"):
            link = _authenticated_raw(driver, node=1)
            link.send({"seq": 1, "hello": {"port": 1, "node": 1, "protocol": PROTOCOL + 1}})
            link.sock.settimeout(5)
            with pytest.raises(ConnectionError):  # closed by the driver (an idle timeout is not)
                while True:
                    link.recv()
            wait_for("the driver's warning", lambda: "dropped an authenticated connection" in caplog.text)
        assert (
            "a malformed message (ProtocolMismatch: node 1 speaks "
            f"channel protocol {PROTOCOL + 1} and this driver speaks channel protocol {PROTOCOL}: the node runs other "
            "spark_torch code than the driver; install the same spark_torch on the driver and the executors)"
        ) in caplog.text
        node = NodeChannel(driver.spec, 0, 2, threading.Event())
        node(0, "stdout", "still here")
        node.close()
        assert (0, "stdout", "still here") in lines.items
    finally:
        driver.close()


def test_attach_as_unknown_node_is_rejected() -> None:
    driver, _ = _driver(nodes=2)
    try:
        link = _authenticated_raw(driver, node=5)
        link.sock.settimeout(5)
        with pytest.raises((ConnectionError, OSError)):
            link.recv()
        assert driver.rejected == 1
    finally:
        driver.close()


def test_close_leaves_no_thread_or_listener() -> None:
    before = set(threading.enumerate())
    driver, _ = _driver(nodes=2)
    port = driver.port
    nodes = [NodeChannel(driver.spec, n, 2, threading.Event()) for n in range(2)]
    stranger = socket.create_connection(("127.0.0.1", port))
    for n, node in enumerate(nodes):
        node(0, "stdout", f"from {n}")
    for node in nodes:
        node.close()
    driver.close()
    stranger.close()
    deadline = time.monotonic() + 5
    while set(threading.enumerate()) - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not set(threading.enumerate()) - before, set(threading.enumerate()) - before
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2)


def test_spec_never_prints_the_secret() -> None:
    spec = ChannelSpec(host="127.0.0.1", port=1, secret=b"\x01" * 32)
    assert "secret" not in repr(spec) and "\\x01" not in repr(spec)
