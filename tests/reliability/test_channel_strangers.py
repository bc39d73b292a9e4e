"""Strangers who can reach the driver's channel port cannot lock nodes out or flood the log:
idle connections over a second old are pushed out by newer ones, younger ones are kept (the
newcomer is refused), and the driver's warnings about them are rate-limited. (A flood from other
addresses: ``test_channel_flood.py``.)"""

from __future__ import annotations

import logging
import socket
import threading
import time

import pytest

from spark_torch.channel.node_end import NodeChannel
from spark_torch.channel.transport import MAX_PENDING_HANDSHAKES, MAX_PENDING_PER_ADDRESS

from .channel_helpers import driver_channel as _driver


def _channel_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("spark-torch-channel")]


def test_idle_strangers_cannot_lock_a_node_out(caplog: pytest.LogCaptureFixture) -> None:
    """40 idle TCP connections to the driver's port, and one more every 10 ms while the node
    attaches: the node (it knows the secret) gets in within seconds, the rendezvous completes,
    and the driver's log gets a handful of lines, not one per stranger."""
    driver, _ = _driver(nodes=2, rendezvous_timeout=15)
    strangers: list[socket.socket] = []
    lock = threading.Lock()
    stop = threading.Event()

    def flood() -> None:
        while not stop.wait(0.01):
            try:
                sock = socket.create_connection(("127.0.0.1", driver.port), timeout=5)
            except OSError:
                continue
            with lock:
                strangers.append(sock)

    nodes: list[NodeChannel] = []
    flooder = threading.Thread(target=flood)
    try:
        with caplog.at_level(logging.WARNING, logger="spark_torch"):
            for _ in range(40):
                strangers.append(socket.create_connection(("127.0.0.1", driver.port), timeout=5))
            flooder.start()
            start = time.monotonic()
            nodes = [NodeChannel(driver.spec, n, 2, threading.Event()) for n in range(2)]
            for n, node in enumerate(nodes):
                assert node.wait_attached(10), (
                    f"node {n} could not attach within 10s while strangers held connections "
                    f"(last error: {node.last_error}); the driver must evict idle pending handshakes"
                )
            outcomes: dict[int, object] = {}
            threads = [
                threading.Thread(target=lambda n=n: outcomes.__setitem__(n, nodes[n].rendezvous({"port": n})))
                for n in range(2)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(20)
            elapsed = time.monotonic() - start
            assert all(getattr(outcomes.get(n), "peers", None) for n in range(2)), (
                f"the rendezvous did not complete: {outcomes}"
            )
            assert elapsed < 10, f"attach and rendezvous took {elapsed:.1f}s"
            stop.set()
            flooder.join(10)
        with lock:
            opened = len(strangers)
        assert driver.rejected >= 40 - MAX_PENDING_PER_ADDRESS, (driver.rejected, opened)
        channel_lines = [r for r in caplog.records if r.name.startswith("spark_torch.channel")]
        assert len(channel_lines) <= 3, [r.getMessage() for r in channel_lines]
        assert "rejected a connection" in channel_lines[0].getMessage()
    finally:
        stop.set()
        if flooder.is_alive():
            flooder.join(10)
        for node in nodes:
            node.close()
        driver.close()
        for sock in strangers:
            sock.close()


def test_pending_handshakes_cost_no_thread_and_are_bounded_per_address() -> None:
    """Many more connections than there are handshake slots, all from one address: no thread is
    started for any of them, and all but the first MAX_PENDING_PER_ADDRESS are refused at once
    (the pending ones are younger than a second: they are kept, the newcomers refused)."""
    driver, _ = _driver()
    socks = []
    try:
        before = len(_channel_threads())
        count = MAX_PENDING_HANDSHAKES + 8
        for _ in range(count):
            socks.append(socket.create_connection(("127.0.0.1", driver.port)))
        deadline = time.monotonic() + 5
        while driver.rejected < count - MAX_PENDING_PER_ADDRESS and time.monotonic() < deadline:
            time.sleep(0.02)
        assert driver.rejected == count - MAX_PENDING_PER_ADDRESS, "the newcomers were not refused"
        assert driver.refused == count - MAX_PENDING_PER_ADDRESS and driver.evicted == 0
        assert len(_channel_threads()) == before, [t.name for t in _channel_threads()]
        # the first ones got the greeting and are still pending; the newest were closed unanswered
        socks[0].settimeout(5)
        assert socks[0].recv(4096)[:18] == b"spark-torch-channe"
        socks[0].setblocking(False)
        with pytest.raises(BlockingIOError):
            socks[0].recv(4096)
        socks[-1].settimeout(5)
        assert socks[-1].recv(4096) == b"", "a refused connection got the greeting"
    finally:
        for sock in socks:
            sock.close()
        driver.close()


def test_a_handshake_pending_at_close_counts_as_rejected() -> None:
    """A stranger still in its handshake when the run ends was refused too (counted, closed)."""
    driver, _ = _driver()
    sock = socket.create_connection(("127.0.0.1", driver.port))
    try:
        sock.settimeout(5)
        assert sock.recv(4096).startswith(b"spark-torch-channel")  # the greeting: it is pending
        driver.close()
        assert driver.rejected == 1
        assert sock.recv(4096) == b"", "the pending connection was not closed"
    finally:
        sock.close()
        driver.close()
