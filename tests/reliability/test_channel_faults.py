"""The channel on an unhappy network: cut connections, idle drops, silent drops, unreachable or
unresponsive drivers. Nothing is lost, nothing waits without a deadline."""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any

import pytest

from spark_torch.base.states import ProblemKind, StopReason
from spark_torch.channel.driver_end import new_secret
from spark_torch.channel.node_end import NodeChannel
from spark_torch.channel.transport import DEAD_AFTER
from spark_torch.shared.spec import ChannelSpec

from ..netproxy import Proxy
from .channel_helpers import driver_channel as _driver
from .channel_helpers import rendezvous_all, through


def _dead_port() -> int:
    """A loopback port where nothing listens (bound, never listening)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port: int = sock.getsockname()[1]
    _KEEP.append(sock)  # keep it bound so nobody else takes it during the test
    return port


_KEEP: list[socket.socket] = []


def test_cut_mid_stream_loses_nothing() -> None:
    """The proxy closes the connection after 20 kB; the node reconnects and resends."""
    driver, lines = _driver()
    proxy = Proxy(cut_after=20_000, faulty=3)
    try:
        node = NodeChannel(through(proxy, driver.spec), 0, 1, threading.Event())
        for i in range(3000):
            node(0, "stdout", f"line {i:05d} " + "x" * 30)
        node.close(timeout=30)
        assert driver.wait_for_nodes(timeout=10)
        assert lines.texts() == [f"line {i:05d} " + "x" * 30 for i in range(3000)]
        assert proxy.cuts == 3 and proxy.connections >= 4
    finally:
        proxy.close()
        driver.close()


def test_cut_during_rendezvous() -> None:
    """Connections cut right after the hello went out: the rendezvous still completes."""
    driver, _ = _driver(nodes=2)
    proxy = Proxy(cut_after=100, faulty=4)
    nodes = [NodeChannel(through(proxy, driver.spec), n, 2, threading.Event()) for n in range(2)]
    try:
        results = rendezvous_all(nodes)
        assert [r.peers for r in results.values()] == [[{"port": 1000, "node": 0}, {"port": 1001, "node": 1}]] * 2
        assert proxy.cuts >= 2
    finally:
        for n in nodes:
            n.close()
        proxy.close()
        driver.close()


def test_idle_cut_is_repaired_and_stop_reaches_a_silent_node() -> None:
    """A load balancer cuts idle connections after 0.5 s; the heartbeat (5 s) is much slower. The
    node reconnects as soon as its connection dies (not at its next heartbeat), and the
    driver's stop reaches it although it never prints."""
    driver, lines = _driver(heartbeat=5.0)
    proxy = Proxy(idle_cut=0.5, faulty=100)
    stop = threading.Event()
    try:
        node = NodeChannel(through(proxy, driver.spec), 0, 1, stop)
        node(0, "stdout", "before the silence")
        time.sleep(2.0)  # several idle cuts happen here
        assert proxy.cuts >= 2
        driver.stop_nodes(StopReason.TIMEOUT)
        assert stop.wait(1.5), "the stop did not reach the silent node"
        node(0, "stdout", "after the silence")
        node.close(timeout=10)
        assert driver.wait_for_nodes(timeout=10)
        assert lines.texts() == ["before the silence", "after the silence"]
    finally:
        proxy.close()
        driver.close()


def test_heartbeats_keep_an_idle_connection_open() -> None:
    """With a heartbeat shorter than the idle cut, a silent node's connection is never cut."""
    driver, _ = _driver(heartbeat=0.2)
    proxy = Proxy(idle_cut=1.0, faulty=100)
    try:
        node = NodeChannel(through(proxy, driver.spec), 0, 1, threading.Event())
        node(0, "stdout", "hi")
        time.sleep(3)
        node.close(timeout=10)
        assert proxy.cuts == 0 and proxy.connections == 1
    finally:
        proxy.close()
        driver.close()


def test_silent_drop_is_noticed_within_seconds() -> None:
    """After 2 kB the proxy swallows everything without closing (a blackhole). The node notices
    by its missing acks/heartbeat answers, reconnects, and every line arrives."""
    driver, lines = _driver(heartbeat=0.25)
    proxy = Proxy(blackhole_after=2000, faulty=1)
    try:
        node = NodeChannel(through(proxy, driver.spec), 0, 1, threading.Event())
        start = time.monotonic()
        for i in range(200):
            node(0, "stdout", f"line {i} " + "y" * 20)
        node.close(timeout=30)
        elapsed = time.monotonic() - start
        assert driver.wait_for_nodes(timeout=10)
        assert lines.texts() == [f"line {i} " + "y" * 20 for i in range(200)]
        assert proxy.connections == 2
        assert elapsed < 0.25 * DEAD_AFTER + 5
    finally:
        proxy.close()
        driver.close()


def test_rendezvous_deadline_when_nothing_listens() -> None:
    spec = ChannelSpec(host="127.0.0.1", port=_dead_port(), secret=new_secret(), rendezvous_timeout=1.0)
    node = NodeChannel(spec, 0, 2, threading.Event())
    try:
        start = time.monotonic()
        outcome = node.rendezvous({"port": 1})
        assert time.monotonic() - start < 1.0 + 1.0
        assert outcome.peers is None and not outcome.stopped
        assert "Connection refused" in outcome.reason and f"127.0.0.1:{spec.port}" in outcome.reason
        assert not node.detach_if_unreachable()
    finally:
        node.close()


def test_rendezvous_deadline_when_the_peer_never_answers() -> None:
    """A listener that accepts TCP but never says a word (a wedged or foreign service)."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    spec = ChannelSpec(host="127.0.0.1", port=silent.getsockname()[1], secret=new_secret(), rendezvous_timeout=1.5)
    node = NodeChannel(spec, 0, 2, threading.Event())
    try:
        start = time.monotonic()
        outcome = node.rendezvous({"port": 1})
        assert outcome.peers is None
        assert time.monotonic() - start < 1.5 + 1.0
        assert not node.detach_if_unreachable()  # what the node runner does next: no waiting
        assert time.monotonic() - start < 1.5 + 2.0
    finally:
        node.close()
        silent.close()


def test_one_node_cannot_reach_the_driver_all_fall_back(caplog: pytest.LogCaptureFixture) -> None:
    """Node 0 reaches the driver, node 1 cannot: both fall back (never split), one warning."""
    driver, _ = _driver(nodes=2, rendezvous_timeout=1.0)
    unreachable = ChannelSpec(host="127.0.0.1", port=_dead_port(), secret=driver.spec.secret, rendezvous_timeout=1.0)
    nodes = [NodeChannel(driver.spec, 0, 2, threading.Event()), NodeChannel(unreachable, 1, 2, threading.Event())]
    try:
        with caplog.at_level(logging.WARNING, logger="spark_torch"):
            results = rendezvous_all(nodes, timeout=10)
        assert all(r.peers is None and not r.stopped for r in results.values())
        assert driver.fell_back
        warnings = [r.getMessage() for r in caplog.records if "could not reach the driver's channel" in r.getMessage()]
        assert len(warnings) == 1
        assert f"at 127.0.0.1:{driver.port}" in warnings[0] and "(node 1)" in warnings[0]
        assert "SPARK_TORCH_CHANNEL_HOST" in warnings[0]
    finally:
        for n in nodes:
            n.close()
        driver.close()


def test_a_late_node_gets_the_decision_already_made() -> None:
    """A node that connects after the driver decided (fallback) is told so at once."""
    driver, _ = _driver(nodes=2, rendezvous_timeout=30)
    try:
        decision, new = driver._coordinator.expire()
        assert new
        node = NodeChannel(driver.spec, 1, 2, threading.Event())
        start = time.monotonic()
        outcome = node.rendezvous({"port": 0})
        assert outcome.peers is None and time.monotonic() - start < 5
        node.close()
    finally:
        driver.close()


class _StuckBarrier:
    """Stands in for BarrierTaskContext in one place only: an allGather that never completes
    (the real fallback runs end to end in test_channel_e2e.py and test_two_hosts.py)."""

    def partitionId(self) -> int:  # noqa: N802 - Spark's name
        return 1

    def getTaskInfos(self) -> list[Any]:  # noqa: N802 - Spark's name
        class Info:
            address = "127.0.0.1:1"

        return [Info(), Info()]

    def allGather(self, message: str) -> list[str]:  # noqa: N802 - Spark's name
        threading.Event().wait(60)
        return []


def test_fallback_allgather_that_never_completes_is_a_launch_error(tmp_path: Any) -> None:
    from spark_torch.node.lifecycle import NodeProblem
    from spark_torch.node.task import BarrierIO
    from spark_torch.shared.sealed import find_sealed
    from spark_torch.shared.spec import LaunchPlan, RunSpec

    channel = ChannelSpec(host="127.0.0.1", port=_dead_port(), secret=new_secret(), rendezvous_timeout=1.0)
    spec = RunSpec(
        plan=LaunchPlan(local_mode=False, num_nodes=2, procs_per_node=1, use_gpu=False), run_id="t", channel=channel
    )
    node = BarrierIO(spec, _StuckBarrier())
    try:
        start = time.monotonic()
        with pytest.raises(NodeProblem) as info:
            node.rendezvous({"port": 0, "python": "3", "rows": 0})
        assert time.monotonic() - start < 1.0 + 1.0 + 2
    finally:
        node.close()
    ends = find_sealed(str(node.failed(info.value.outcome())), channel.secret)
    assert list(ends) == [node.node_rank] and ends[node.node_rank] == info.value.outcome()
    problem = ends[node.node_rank].problem
    assert problem is not None and not ends[node.node_rank].failures
    kind, message = problem.kind, problem.message
    assert kind is ProblemKind.LAUNCH
    assert f"127.0.0.1:{channel.port}" in message and "allGather fallback did not complete within 1s" in message
    assert "Connection refused" in message and "SPARK_TORCH_CHANNEL_HOST" in message
