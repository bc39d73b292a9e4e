"""The channel encrypts: a passive observer of the network sees no rank output, metric or result
bytes, and an active one cannot alter, inject, replay, reorder or reflect a frame without the
driver closing the connection (the node then reconnects and nothing is lost or doubled)."""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time

import pytest

from spark_torch.channel import wire
from spark_torch.channel.driver_end import DriverChannel
from spark_torch.channel.node_end import NodeChannel

from ..netproxy import Proxy
from .channel_helpers import Bulk, Reports, sealed_frame, through, wait_for
from .channel_helpers import driver_channel as _driver


def test_a_passive_observer_sees_no_cleartext() -> None:
    """Every byte between a node and the driver, recorded by a proxy: the log line, the metric
    (name and value) and the result bytes all reached the driver, and none is in the record."""
    driver, lines = _driver()
    reports, bulk = Reports(), Bulk()
    driver.reports, driver.bulk_sink = reports, bulk
    proxy = Proxy(record=True, faulty=0)
    node = NodeChannel(through(proxy, driver.spec), 0, 1, threading.Event())
    try:
        result = b"RESULT-BYTES-0123456789" * 50_000  # ~1.1 MiB: two binary frames
        node(0, "stdout", "a log line with SECRET-LOG-TEXT in it")
        node.forward_report({"node": 0, "step": 1, "metrics": {"secret_metric_name": 0.8125}})
        node.send_bulk({"offset": 0}, memoryview(result)[: node.bulk_piece], time.monotonic() + 10)
        node.send_bulk({"offset": node.bulk_piece}, memoryview(result)[node.bulk_piece :], time.monotonic() + 10)
        assert node.drain(10), "the driver did not acknowledge the messages"
        node.close()
        assert driver.wait_for_nodes(10), "the node's end-of-stream marker did not arrive"
    finally:
        node.close()
        proxy.close()
        driver.close()
    # everything arrived (so it went through the proxy)...
    assert "a log line with SECRET-LOG-TEXT in it" in lines.texts()
    assert reports.got == [{"node": 0, "step": 1, "metrics": {"secret_metric_name": 0.8125}}]
    assert bytes(bulk.data) == result
    # ... and none of it in clear on the wire
    seen = bytes(proxy.recorded)
    assert wire.MAGIC in seen, "the proxy recorded nothing"
    for secret in (b"SECRET-LOG-TEXT", b"secret_metric_name", b"0.8125", b"RESULT-BYTES", b'"lines"', b'"seq"'):
        assert secret not in seen, f"{secret!r} crossed the network in clear"


def _authenticated(driver: DriverChannel, node: int = 0) -> wire.Link:
    sock = socket.create_connection(("127.0.0.1", driver.port))
    link = wire.client_handshake(sock, driver.spec.secret, time.monotonic() + 5, 5.0)
    link.send({"attach": node})
    return link


def _read_raw_frame(sock: socket.socket) -> bytes:
    header = wire._recv_exact(sock, 4, time.monotonic() + 5)
    (size,) = struct.unpack(">I", header)
    return bytes(header) + bytes(wire._recv_exact(sock, size + wire.TAG_BYTES, time.monotonic() + 5))


def _closed_by_peer(sock: socket.socket, seconds: float = 10.0) -> bool:
    """Read (and discard) until the peer closes; False if it is still open after ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            if not sock.recv(65536):
                return True
        except TimeoutError:
            return False
        except OSError:
            return True
    return False


@pytest.mark.parametrize("attack", ["altered", "injected", "replayed", "reordered", "reflected"])
def test_a_tampered_frame_closes_the_drivers_connection(attack: str) -> None:
    """An authenticated connection to the real driver; one forged frame on it: the driver closes
    the connection and hands nothing forged on."""
    driver, lines = _driver()
    link = _authenticated(driver)
    try:
        evil = {"seq": 1, "lines": [[0, "stdout", "forged"]]}
        if attack == "altered":
            frame = bytearray(sealed_frame(link, evil))
            frame[10] ^= 0x01
            link.sock.sendall(bytes(frame))
        elif attack == "injected":  # a frame made without the keys
            body = wire.encode(evil)
            assert isinstance(body, bytes)
            link.sock.sendall(struct.pack(">I", len(body)) + body + bytes(wire.TAG_BYTES))
        elif attack == "replayed":
            frame = sealed_frame(link, {"seq": 1, "lines": [[0, "stdout", "once"]]})
            link.sock.sendall(frame)
            wait_for("the first copy to be delivered", lambda: "once" in lines.texts())
            link.sock.sendall(frame)
        elif attack == "reordered":
            first = sealed_frame(link, {"seq": 1, "lines": [[0, "stdout", "first"]]})
            second = sealed_frame(link, {"seq": 2, "lines": [[0, "stdout", "second"]]})
            link.sock.sendall(second + first)
        elif attack == "reflected":  # a frame the driver sent, played back to it
            link.send({"ping": 1})
            link.sock.sendall(_read_raw_frame(link.sock))
        assert _closed_by_peer(link.sock), f"the driver kept a connection that sent a {attack} frame"
        assert lines.texts() == (["once"] if attack == "replayed" else [])
    finally:
        link.close()
        driver.close()


@pytest.mark.parametrize("when", ["after the attach", "as the first frame"])
def test_tampering_gets_its_own_warning_that_strangers_cannot_suppress(
    when: str, caplog: pytest.LogCaptureFixture
) -> None:
    """50 strangers' rejections use up the rate-limited warning about strangers; then a forged
    frame on an authenticated connection: its own warning line still appears, naming what happened."""
    driver, _ = _driver()
    link = None
    try:
        with caplog.at_level(logging.WARNING, logger="spark_torch.channel"):
            for _ in range(50):
                socket.create_connection(("127.0.0.1", driver.port), timeout=5).close()
            wait_for("the strangers' rejections", lambda: driver.rejected >= 50)
            assert sum("rejected a connection" in r.getMessage() for r in caplog.records) == 1  # the rest suppressed
            sock = socket.create_connection(("127.0.0.1", driver.port))
            link = wire.client_handshake(sock, driver.spec.secret, time.monotonic() + 5, 5.0)
            if when == "after the attach":
                link.send({"attach": 0})
            frame = bytearray(sealed_frame(link, {"seq": 1, "lines": [[0, "stdout", "forged"]]}))
            frame[10] ^= 0x01
            link.sock.sendall(bytes(frame))
            assert _closed_by_peer(link.sock), "the driver kept a connection that sent an altered frame"
            wait_for("the tampering warning", lambda: any("authenticated" in r.getMessage() for r in caplog.records))
        (line,) = [r for r in caplog.records if "authenticated" in r.getMessage()]
        assert line.levelno == logging.WARNING
        assert "dropped an authenticated connection" in line.getMessage() and "failed to decrypt" in line.getMessage()
    finally:
        if link is not None:
            link.close()
        driver.close()


def test_a_corrupted_connection_is_replaced_and_nothing_is_lost() -> None:
    """A proxy flips one bit of what the node sends, 3 kB into its first connection: the driver
    drops that connection, the node reconnects and every line arrives once, in order."""
    driver, lines = _driver()
    proxy = Proxy(corrupt_at=3000, faulty=1)
    try:
        node = NodeChannel(through(proxy, driver.spec), 0, 1, threading.Event())
        for i in range(500):
            node(0, "stdout", f"line {i:04d} " + "z" * 20)
        node.close(timeout=30)
        assert driver.wait_for_nodes(timeout=10), "the node's end-of-stream marker did not arrive"
        assert lines.texts() == [f"line {i:04d} " + "z" * 20 for i in range(500)]
        assert proxy.connections == 2
    finally:
        proxy.close()
        driver.close()
