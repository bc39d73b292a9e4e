"""Shared by the channel tests: a line sink that records, and a driver end on loopback."""

from __future__ import annotations

import threading
from typing import Any

from spark_torch.channel.driver_end import DriverChannel, new_secret


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
