"""The channel server at simulated scale: 256 real node clients on loopback against one driver
end: handshakes, the rendezvous, log blocks, heartbeats and one node's result stream; everything
arrives and every thread is gone after close. (Timings and resource use at 32/128/256 nodes:
``benchmarks/bench_channel.py``.)"""

from __future__ import annotations

import threading
import time
from typing import Any

from spark_torch.channel.node_end import NodeChannel
from spark_torch.channel.transport import DEAD_AFTER

from .channel_helpers import Bulk
from .channel_helpers import driver_channel as _driver

NODES = 256
#: 256 nodes' threads share one interpreter here: a connection is given up after DEAD_AFTER
#: heartbeats of silence, and at 0.5 s (2 s) one of them went unanswered once in a fresh-clone run
HEARTBEAT = 1.0
BLOCKS = 3
LINES = 10


class _OrderedBulk(Bulk):
    """Keeps the bytes and refuses a piece out of place."""

    def piece(self, node: int, header: Any, data: Any) -> None:
        if node != 0 or header.get("offset") != len(self.data):
            raise ValueError(f"unexpected piece {header} from node {node}")
        self.data += data


def _channel_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("spark-torch-channel")]


def test_256_nodes_against_one_driver() -> None:
    before = set(threading.enumerate())
    driver, lines = _driver(nodes=NODES, heartbeat=HEARTBEAT, rendezvous_timeout=60)
    bulk = driver.bulk_sink = _OrderedBulk()
    nodes = [NodeChannel(driver.spec, n, NODES, threading.Event()) for n in range(NODES)]
    try:
        outcomes: dict[int, Any] = {}
        callers = [
            threading.Thread(target=lambda n=n: outcomes.__setitem__(n, nodes[n].rendezvous({"port": n})))
            for n in range(NODES)
        ]
        for t in callers:
            t.start()
        for t in callers:
            t.join(90)
        assert len(outcomes) == NODES and all(o.peers is not None for o in outcomes.values()), (
            f"{sum(1 for o in outcomes.values() if o.peers)} of {NODES} nodes got the rendezvous decision"
        )
        expected = [{"port": n, "node": n} for n in range(NODES)]
        assert all(o.peers == expected for o in outcomes.values())
        assert driver.connected_nodes == set(range(NODES))
        for block in range(BLOCKS):
            for n, node in enumerate(nodes):
                node(n, "stdout", "\n".join(f"node {n} block {block} line {i}" for i in range(LINES)))
        result = bytes(range(256)) * (8 * 4096)  # 8 MiB
        piece = nodes[0].bulk_piece
        for offset in range(0, len(result), piece):
            nodes[0].send_bulk({"offset": offset}, memoryview(result)[offset : offset + piece], time.monotonic() + 30)
        assert nodes[0].drain(30), "the driver did not acknowledge node 0's result"
        # quiet for longer than either end waits for a word (DEAD_AFTER heartbeats): only the
        # heartbeats and the driver's answers keep all 256 connections up
        time.sleep(HEARTBEAT * DEAD_AFTER * 1.5)
        for node in nodes:
            node.close(timeout=30)
        assert driver.wait_for_nodes(30), "not every node's end-of-stream marker arrived"
        assert bytes(bulk.data) == result
        texts = lines.texts()
        assert len(texts) == NODES * BLOCKS * LINES
        for n in (0, 1, NODES // 2, NODES - 1):
            mine = [t for t in texts if t.startswith(f"node {n} ")]
            assert mine == [f"node {n} block {b} line {i}" for b in range(BLOCKS) for i in range(LINES)]
        assert all(node.connections == 1 for node in nodes), "a connection was dropped (missed heartbeats?)"
    finally:
        for node in nodes:
            node.close(timeout=5)
        driver.close()
    deadline = time.monotonic() + 10
    while set(threading.enumerate()) - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not set(threading.enumerate()) - before, _channel_threads()
