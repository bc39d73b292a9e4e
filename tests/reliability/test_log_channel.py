"""The driver's log channel: authenticated, bounded, text only; strangers do not affect a run."""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from typing import Any

import pytest

from spark_torch import Distributor
from spark_torch.base.states import GroupState, RankState, StopReason, StopSignal
from spark_torch.channel.driver_end import DriverChannel
from spark_torch.channel.log_stream import QUEUE_LINES
from spark_torch.channel.node_end import NodeChannel
from spark_torch.channel.wire import MAX_FRAME
from spark_torch.shared.node_outcome import NodeOutcome
from spark_torch.shared.spec import ChannelSpec

from .channel_helpers import driver_channel as _driver
from .channel_helpers import rendezvous_all


def _node(spec: ChannelSpec, node: int = 0, nodes: int = 1, stop: threading.Event | None = None) -> NodeChannel:
    return NodeChannel(spec, node, nodes, stop or threading.Event())


def test_client_delivers_in_order_and_drains() -> None:
    server, lines = _driver()
    try:
        client = _node(server.spec)
        for i in range(5000):
            client(1, "stdout", f"line {i}")
        client.close()
        assert server.wait_for_nodes(timeout=10)
        assert [t for _, _, t in lines.items] == [f"line {i}" for i in range(5000)]
    finally:
        server.close()


def test_batches_larger_than_a_frame_are_split() -> None:
    """Control characters escape to 6 bytes each in JSON: a batch that far exceeds MAX_FRAME
    once encoded still arrives complete and in order."""
    server, lines = _driver()
    try:
        client = _node(server.spec)
        batch = [f"{i:05d}" + "\x01" * 60_000 for i in range(40)]  # ~14 MB of JSON
        client(0, "stderr", "\n".join(batch))
        client(0, "stdout", "after")
        client.close(timeout=60)
        assert server.wait_for_nodes(timeout=30)
        assert [t for _, _, t in lines.items] == [*batch, "after"]
        assert {s for _, s, _ in lines.items} == {"stderr", "stdout"}
    finally:
        server.close()


def test_full_queue_drops_and_reports() -> None:
    """Beyond QUEUE_LINES queued lines new batches are dropped, counted and reported, never blocking."""
    server, lines = _driver(nodes=4)
    try:
        client = _node(server.spec, 3, 4)
        with client._queue.cond:  # hold the sender off so the queue fills up
            start = time.monotonic()
            client(0, "stdout", "\n".join(["x"] * QUEUE_LINES))
            client(0, "stdout", "\n".join(["lost"] * 5))
            assert time.monotonic() - start < 1.0
        client.close(timeout=60)
        assert server.wait_for_nodes(timeout=60)
        texts = [t for _, _, t in lines.items]
        assert texts.count("x") == QUEUE_LINES and "lost" not in texts
        assert "[spark_torch] 5 log line(s) dropped on node 3" in texts
        assert server.dropped == 5
    finally:
        server.close()


def test_rendezvous_through_the_channel() -> None:
    """Every node says hello; each gets all hellos in node order (what a Spark allGather gave)."""
    server, _ = _driver(nodes=3)
    clients = [_node(server.spec, n, 3) for n in range(3)]
    try:
        start = time.monotonic()
        got = {n: outcome.peers for n, outcome in rendezvous_all(clients, timeout=10).items()}
        assert time.monotonic() - start < 5
        expected = [{"port": 1000 + n, "node": n} for n in range(3)]
        assert got == {0: expected, 1: expected, 2: expected}
    finally:
        for c in clients:
            c.close()
        server.close()


def test_rendezvous_stopped_before_every_node_said_hello() -> None:
    server, _ = _driver(nodes=2)
    stop = threading.Event()
    client = _node(server.spec, 0, 2, stop)
    try:
        threading.Timer(0.5, server.stop_nodes, args=(StopReason.TIMEOUT,)).start()
        start = time.monotonic()
        assert client.rendezvous({"port": 1}).stopped
        assert time.monotonic() - start < 5
    finally:
        client.close()
        server.close()


def test_wrong_secret_rejected() -> None:
    server, lines = _driver()
    try:
        spec = ChannelSpec(host="127.0.0.1", port=server.port, secret=b"wrong" * 8)
        client = _node(spec)
        client(0, "stdout", "should not arrive")
        client.close(timeout=1.0)
        assert not lines.items and server.rejected >= 1 and not client.connected_ever
        assert "did not prove" in (client.last_error or "") or "closed" in (client.last_error or "")
    finally:
        server.close()


def _stranger(port: int, payload: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        nonce = sock.recv(64)
        try:
            sock.sendall(payload)
            return nonce + sock.recv(16)
        except OSError:
            return nonce


def hello_lines(count: int) -> int:
    for i in range(count):
        print(f"hello {i}")
    return count


def test_strangers_do_not_affect_a_run(
    spark_session: Any, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture, no_leftovers: None
) -> None:
    """Garbage, huge frames and bad handshakes on the log port are rejected and logged."""
    seen: list[DriverChannel] = []

    class Spy(DriverChannel):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            seen.append(self)
            for payload in (b"garbage" * 10, struct.pack(">I", MAX_FRAME * 8) + b"x" * 32, b""):
                threading.Thread(target=_stranger, args=(self.port, payload), daemon=True).start()

    import spark_torch.driver.run.barrier as barrier

    barrier.DriverChannel = Spy  # type: ignore[misc]
    try:
        out = Distributor(num_processes=2, local_mode=False, spark=spark_session).run(hello_lines, 300)
    finally:
        barrier.DriverChannel = DriverChannel  # type: ignore[misc]
    assert out == 300
    text = capsys.readouterr().out
    for rank in (0, 1):
        for i in (0, 150, 299):
            assert f"[rank {rank}] hello {i}" in text
    assert seen and seen[0].spec.host == "127.0.0.1"
    deadline = time.monotonic() + 10
    while seen[0].rejected < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert seen[0].rejected >= 3
    assert "rejected a connection" in caplog.text


def test_secret_not_in_command_lines_or_env(spark_session: Any, no_leftovers: None) -> None:
    import spark_torch.channel.driver_end as channel

    secrets: list[bytes] = []
    real = channel.new_secret

    def spy() -> bytes:
        secrets.append(real())
        return secrets[-1]

    import spark_torch.driver.run.barrier as barrier

    barrier.new_secret = spy  # type: ignore[assignment]
    try:
        out = Distributor(num_processes=2, local_mode=False, spark=spark_session).run(_environment_and_cmdline)
    finally:
        barrier.new_secret = real  # type: ignore[assignment]
    secret = secrets[0]
    for blob in out:
        assert secret.hex() not in blob and secret.decode("latin-1") not in blob


def _environment_and_cmdline() -> list[str]:
    with open(f"/proc/{os.getppid()}/cmdline", "rb") as fh:
        parent = fh.read().decode("latin-1")
    with open("/proc/self/cmdline", "rb") as fh:
        mine = fh.read().decode("latin-1")
    return [parent, mine, repr(dict(os.environ))]


def test_client_reconnects_after_connection_drop() -> None:
    """The driver side drops every connection mid-stream; the node runner reconnects and goes on."""
    server, lines = _driver()
    try:
        client = _node(server.spec)
        for i in range(100):
            client(0, "stdout", f"before {i}")
        deadline = time.monotonic() + 10
        while len(lines.items) < 100 and time.monotonic() < deadline:
            time.sleep(0.01)
        with server._server._lock:  # what a network failure does: the connection is gone
            links = list(server._server._links.values())
        for link in links:
            link.sock.shutdown(socket.SHUT_RDWR)
        for i in range(100):
            client(0, "stdout", f"after {i}")
        client.close()
        assert server.wait_for_nodes(timeout=15)
        texts = [t for _, _, t in lines.items]
        assert texts[:100] == [f"before {i}" for i in range(100)]
        assert [t for t in texts if t.startswith("after")] == [f"after {i}" for i in range(100)]
    finally:
        server.close()


def test_the_stop_reason_reaches_the_node_and_its_end_comes_back() -> None:
    """The driver's reason travels with its stop; the node's end (each rank's state, the reason
    it acted on) arrives before its last line."""
    driver, _ = _driver()
    stop = StopSignal()
    try:
        node = _node(driver.spec, stop=stop)
        assert node.wait_attached(10), "the node did not attach to the driver within 10 s"
        driver.stop_nodes(StopReason.STALLED)
        assert stop.wait(10), "the driver's stop did not reach the node within 10 s"
        assert stop.reason is StopReason.STALLED
        end = NodeOutcome(GroupState.STOPPED, {0: RankState.FINISHED, 1: RankState.STOPPED}, stop.reason)
        node.send_outcome(end)
        node.close()
        assert driver.wait_for_nodes(timeout=10), "the node's last line did not reach the driver within 10 s"
        assert driver.node_outcomes() == {0: end}
    finally:
        driver.close()
