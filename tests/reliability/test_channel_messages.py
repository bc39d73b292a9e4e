"""Nothing is dropped silently on the channel: a message that cannot be sent raises at the sender
and nothing queued with it is lost; bulk log output is bounded in bytes too; a driver that
cannot take bulk data says so to the node; handler calls for one node never overlap."""

from __future__ import annotations

import errno
import logging
import socket
import threading
import time
from typing import Any

import pytest

from spark_torch.base.states import GroupState, StopReason, StopSignal
from spark_torch.channel import wire
from spark_torch.channel.log_stream import QUEUE_BYTES
from spark_torch.channel.messages import PROTOCOL
from spark_torch.channel.node_end import NodeChannel
from spark_torch.channel.server import ChannelServer
from spark_torch.errors import RankFailure
from spark_torch.shared.node_outcome import NodeOutcome

from .channel_helpers import Reports, wait_for
from .channel_helpers import driver_channel as _driver


def test_a_report_that_cannot_be_encoded_raises_at_the_sender_and_nothing_else_is_lost() -> None:
    """A metric with a lone surrogate (what surrogateescape makes of bad bytes): forward_report
    raises before anything is queued; the lines around it, the next report and the node's
    end-of-stream marker all arrive."""
    driver, lines = _driver()
    reports = driver.reports = Reports()
    node = NodeChannel(driver.spec, 0, 1, threading.Event())
    try:
        node(0, "stdout", "before")
        with pytest.raises(ValueError, match="surrogate"):
            node.forward_report({"node": 0, "step": 1, "metrics": {"name": "bad \udcff bytes"}})
        node(0, "stdout", "after")
        node.forward_report({"node": 0, "step": 2, "metrics": {"loss": 0.5}})
        node.close()
        assert driver.wait_for_nodes(10), "the node's end-of-stream marker did not arrive"
        assert lines.texts() == ["before", "after"]
        assert reports.got == [{"node": 0, "step": 2, "metrics": {"loss": 0.5}}]
    finally:
        node.close()
        driver.close()


def test_an_oversized_message_raises_at_the_sender() -> None:
    driver, lines = _driver()
    driver.reports = Reports()
    node = NodeChannel(driver.spec, 0, 1, threading.Event())
    try:
        with pytest.raises(wire.FrameTooLarge, match="exceeds"):
            node.forward_report({"node": 0, "step": 1, "metrics": {"blob": "x" * wire.MAX_FRAME}})
        node(0, "stdout", "still here")
        node.close()
        assert driver.wait_for_nodes(10), "the node's end-of-stream marker did not arrive"
        assert lines.texts() == ["still here"]
    finally:
        node.close()
        driver.close()


def test_a_huge_node_end_arrives_cut_to_fit() -> None:
    """40 failed ranks, each with 40 x 64 KiB of last lines, a long traceback and a pickled
    exception (several MiB): the report still reaches the driver, every rank's cause intact (the
    head and the final line of its traceback, the newest output line), the cut said, and the
    node's other messages arrive."""
    driver, lines = _driver()
    node = NodeChannel(driver.spec, 0, 1, threading.Event())
    try:
        node(0, "stdout", "before the failure")
        wait_for("the node to attach", lambda: node.connected_ever)
        failures = tuple(
            RankFailure(
                rank=r,
                host="h",
                exc_type="ValueError",
                exc_message="boom " + "m" * 20_000,
                traceback="Traceback (most recent call last):\n" + "t" * 100_000 + f"\nValueError: boom in rank {r}",
                last_lines=tuple(f"{i}" + "y" * 65535 for i in range(40)),
            )
            for r in range(40)
        )
        outcome = NodeOutcome(GroupState.FAILED, failures=failures, pickled={r: "p" * 60_000 for r in range(40)})
        node.send_outcome(outcome, wait=10)
        node.close()
        assert driver.wait_for_nodes(10), "the node's end-of-stream marker did not arrive"
        report = driver.node_outcomes()[0]
        assert sorted(f.rank for f in report.failures) == list(range(40))
        for f in report.failures:
            assert (f.exc_type, (f.exc_message or "")[:4]) == ("ValueError", "boom")
            assert (f.traceback or "").startswith("Traceback (most recent call last):")
            assert (f.traceback or "").endswith(f"ValueError: boom in rank {f.rank}"), "the final line was lost"
            assert "characters cut]" in (f.traceback or "")
            assert f.last_lines[-1].startswith("39y") and "earlier line(s) cut" in f.last_lines[0]
        assert not report.pickled, "the pickled exceptions should stay behind first"
        assert lines.texts() == ["before the failure"]
    finally:
        node.close()
        driver.close()


def test_a_log_line_with_a_lone_surrogate_arrives_repaired() -> None:
    driver, lines = _driver()
    node = NodeChannel(driver.spec, 0, 1, threading.Event())
    try:
        node(0, "stdout", "one\nbad \udcff byte\nthree")
        node.close()
        assert driver.wait_for_nodes(10), "the node's end-of-stream marker did not arrive"
        assert lines.texts() == ["one", "bad \\udcff byte", "three"]
    finally:
        node.close()
        driver.close()


def test_a_flood_of_huge_lines_stays_within_the_byte_bound() -> None:
    """64 KiB lines while the sender is held off: the queue stops at QUEUE_BYTES (the line bound
    alone would let it hold ~12 GiB), the rest is dropped, counted and reported."""
    driver, lines = _driver()
    node = NodeChannel(driver.spec, 0, 1, threading.Event())
    line = "w" * 65535
    fitting = QUEUE_BYTES // len(line)
    try:
        with node._queue.cond:  # hold the sender off so the queue fills up
            for _ in range(fitting + 30):
                node(0, "stdout", line)
        node.close(timeout=60)
        assert driver.wait_for_nodes(timeout=60), "the node's end-of-stream marker did not arrive"
        texts = lines.texts()
        assert texts.count(line) == fitting
        assert "[spark_torch] 30 log line(s) dropped on node 0" in texts
        assert driver.dropped == 30
    finally:
        node.close()
        driver.close()


class _FullDisk:
    """A bulk sink whose disk is full."""

    def __init__(self) -> None:
        self.calls = 0

    def piece(self, node: int, header: Any, data: Any) -> None:
        self.calls += 1
        raise OSError(errno.ENOSPC, "No space left on device")


def test_a_bulk_sink_failure_reaches_the_node(caplog: pytest.LogCaptureFixture) -> None:
    """The driver's disk is full at the first piece of rank 0's result: the node's send_bulk and
    drain fail with the driver's reason (so the result goes through Spark instead), the driver
    logs it once at ERROR, and the channel goes on (lines, end of stream)."""
    driver, lines = _driver()
    sink = driver.bulk_sink = _FullDisk()
    node = NodeChannel(driver.spec, 0, 1, threading.Event())
    data = memoryview(bytes(4 * node.bulk_piece))
    try:
        with caplog.at_level(logging.DEBUG, logger="spark_torch"):
            failed: str | None = None
            try:
                for i in range(4):
                    piece = data[i * node.bulk_piece : (i + 1) * node.bulk_piece]
                    node.send_bulk({"offset": i * node.bulk_piece}, piece, time.monotonic() + 10)
                delivered = node.drain(10)
            except ConnectionError as exc:
                failed, delivered = str(exc), False
            assert not delivered, "drain() said the driver has the data; its disk was full"
            with pytest.raises(ConnectionError, match="No space left on device"):
                node.send_bulk({"offset": 0}, data[:10], time.monotonic() + 10)
            assert node.drain(10) is False
            assert failed is None or "No space left on device" in failed
            node(0, "stdout", "after the failure")
            node.close()
            assert driver.wait_for_nodes(10), "the node's end-of-stream marker did not arrive"
        assert lines.texts() == ["after the failure"]
        assert sink.calls == 1
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1 and "No space left on device" in errors[0].getMessage(), [
            r.getMessage() for r in errors
        ]
        assert not [r for r in caplog.records if r.levelno == logging.WARNING]
    finally:
        node.close()
        driver.close()


class _Recorder:
    """A server handler that holds its first message until released and notes any overlap."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.active = 0
        self.overlap = False
        self.seen: list[int] = []
        self.entered = threading.Semaphore(0)
        self.release = threading.Event()

    def attached(self, node: int) -> list[dict[str, Any]]:
        return []

    def message(self, node: int, message: dict[str, Any]) -> None:
        with self.lock:
            self.active += 1
            self.overlap |= self.active > 1
            self.seen.append(message["seq"])
        self.entered.release()
        try:
            if message["seq"] == 1:
                self.release.wait(10)
        finally:
            with self.lock:
                self.active -= 1

    def detached(self, node: int) -> None:
        pass


def _attach(port: int, secret: bytes, node: int) -> wire.Link:
    sock = socket.create_connection(("127.0.0.1", port))
    link = wire.client_handshake(sock, secret, time.monotonic() + 5, 5.0)
    link.send({"attach": node})
    return link


def test_a_reconnect_cannot_run_two_handler_calls_for_one_node_at_once() -> None:
    """Node 0's message 1 is still being handled when node 0 reconnects and resends 1 and 2:
    message 2 is handled only after message 1, never beside it."""
    handler = _Recorder()
    secret = b"s" * 32
    server = ChannelServer("127.0.0.1", secret, handler, nodes=1)
    links: list[wire.Link] = []
    try:
        links.append(_attach(server.port, secret, 0))
        links[0].send({"seq": 1, "slow": True})
        assert handler.entered.acquire(timeout=10), "the handler never got message 1"
        links.append(_attach(server.port, secret, 0))  # the reconnect: resends what was not acked
        links[1].send({"seq": 1, "slow": True})
        links[1].send({"seq": 2, "fast": True})
        # (the broken code handles message 2 at once, beside message 1)
        second_beside_first = handler.entered.acquire(timeout=2)
        handler.release.set()
        assert second_beside_first or handler.entered.acquire(timeout=10), "the handler never got message 2"
        assert not handler.overlap, "two handler calls for node 0 ran at once"
        assert handler.seen == [1, 2]
    finally:
        handler.release.set()
        for link in links:
            link.close()
        server.close()


class _BrokenDisk:
    """A server handler whose storage fails for messages marked ``fail``."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def attached(self, node: int) -> list[dict[str, Any]]:
        return []

    def message(self, node: int, message: dict[str, Any]) -> None:
        if message.get("fail"):
            raise OSError(errno.EIO, "Input/output error on the driver's disk")
        self.seen.append(message["seq"])

    def detached(self, node: int) -> None:
        pass


def test_a_handler_failure_is_logged_at_error_and_the_connection_stays(caplog: pytest.LogCaptureFixture) -> None:
    """The driver's own failure handling a message is not a disconnect: logged once at ERROR
    (not hidden at DEBUG), the message acknowledged, the next one handled on the same connection."""
    handler = _BrokenDisk()
    secret = b"s" * 32
    server = ChannelServer("127.0.0.1", secret, handler, nodes=1)
    link = _attach(server.port, secret, 0)
    try:
        with caplog.at_level(logging.DEBUG, logger="spark_torch"):
            link.send({"seq": 1, "fail": True})
            link.send({"seq": 2, "fine": True})
            link.sock.settimeout(10)
            acks = [link.recv().get("ack") for _ in range(2)]
        assert acks == [1, 2]
        assert handler.seen == [2]
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1 and "Input/output error on the driver's disk" in errors[0], errors
    finally:
        link.close()
        server.close()


def test_a_driver_message_the_node_cannot_read_is_logged_and_ignored(caplog: pytest.LogCaptureFixture) -> None:
    """A driver that says something this node cannot read (other code): the node logs it at
    WARNING with the kind and the fix, keeps its connection and still hears the driver's stop."""
    driver, _ = _driver()
    stop = StopSignal()
    node = NodeChannel(driver.spec, 0, 1, stop)
    try:
        wait_for("the node to attach", lambda: 0 in driver.connected_nodes)
        with caplog.at_level(logging.WARNING, logger="spark_torch.channel"):
            driver._server.send(0, {"frobnicate": 1})
            driver.stop_nodes(StopReason.TIMEOUT)
            assert stop.wait(10), "the driver's stop did not arrive"
        assert stop.reason is StopReason.TIMEOUT and node.connections == 1
        assert (
            "node 0 ignored a message of the driver: an unknown message 'frobnicate' from the driver (this side speaks "
            f"channel protocol {PROTOCOL}): the driver runs other spark_torch code; install the same spark_torch on "
            "the driver and the executors"
        ) in caplog.text
    finally:
        node.close()
        driver.close()
