"""The control layer of the channel: the nodes' rendezvous, decided once by the driver.

Every node says hello (node 0's hello carries the port it reserved for the ranks' master).
When all nodes did, the driver answers every node with all hellos in node order ("peers"),
which is what a Spark barrier ``allGather`` round would give, in milliseconds instead of about a
second. When some node cannot reach the driver, nobody waits forever: a connected node that hit
its rendezvous deadline asks the driver to give up, and the driver itself gives up a while after
the nodes' deadline; the decision is then "fallback" and every node goes through one Spark
``allGather`` round instead. The decision is made once, under a lock, and replayed to a node
that reconnects, so nodes never disagree about which way the rendezvous went (a node that
never reached the driver can only fall back, and the driver can then only decide fallback).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from spark_torch.channel.messages import Hello, Rendezvous

__all__ = ["RendezvousCoordinator", "RendezvousResult", "result_of", "fallback_warning", "GIVE_UP_SECONDS"]
#: after its deadline, how long a connected node waits for the driver's answer to "give up"
#: (the driver gives up on nodes that never reach it this long after their own deadline)
GIVE_UP_SECONDS = 5.0


@dataclass(frozen=True)
class RendezvousResult:
    """How a node's rendezvous ended: with every node's hello, or fallback, or stopped."""

    peers: list[dict[str, Any]] | None = None
    stopped: bool = False
    #: why the channel rendezvous did not happen (fallback)
    reason: str = ""


class RendezvousCoordinator:
    """Driver side: collects hellos and makes the one decision (thread-safe)."""

    def __init__(self, nodes: int) -> None:
        self._nodes = nodes
        self._lock = threading.Lock()
        self._hellos: dict[int, Hello] = {}
        self.decision: Rendezvous | None = None
        #: what nodes that gave up reported (e.g. their last connection error)
        self.reports: dict[int, str] = {}

    def hello(self, node: int, hello: Hello) -> Rendezvous | None:
        """Record a hello; returns the decision if this hello completed the rendezvous."""
        if hello.node != node:
            raise ValueError(f"node {node} sent a hello naming node {hello.node}")
        with self._lock:
            self._hellos.setdefault(node, hello)
            if self.decision is None and len(self._hellos) == self._nodes:
                self.decision = Rendezvous(peers=tuple(self._hellos[n].peer() for n in range(self._nodes)))
                return self.decision
            return None

    def give_up(self, node: int, reason: str | None) -> tuple[Rendezvous, bool]:
        """A node hit its deadline. Returns the decision and whether it was made just now."""
        with self._lock:
            if reason:
                self.reports[node] = reason[:500]
            return self._fall_back(f"node {node} gave up waiting")

    def expire(self) -> tuple[Rendezvous, bool]:
        """The driver's own deadline passed."""
        with self._lock:
            return self._fall_back("the driver's rendezvous deadline passed")

    def _fall_back(self, reason: str) -> tuple[Rendezvous, bool]:
        if self.decision is not None:
            return self.decision, False
        self.decision = Rendezvous(reason=reason)
        return self.decision, True

    def missing(self) -> list[int]:
        """Nodes that did not say hello (yet)."""
        with self._lock:
            return [n for n in range(self._nodes) if n not in self._hellos]


def result_of(decision: Rendezvous, nodes: int) -> RendezvousResult | None:
    """A node's view of the driver's decision; None if its peers are not ``nodes`` hellos."""
    if decision.peers is None:
        return RendezvousResult(reason=decision.reason)
    if len(decision.peers) != nodes:
        return None
    return RendezvousResult(peers=[dict(peer) for peer in decision.peers])


def fallback_warning(address: str, nodes: int, missing: list[int], timeout: float, errors: list[str]) -> str:
    """The one warning the driver prints when the rendezvous falls back to Spark's allGather."""
    who = ", ".join(map(str, missing)) if missing else "none"
    seen = f" Errors the nodes saw: {'; '.join(errors)}." if errors else ""
    return (
        f"spark_torch: {len(missing)} of {nodes} node(s) (node {who}) could not reach the driver's "
        f"channel at {address} within {timeout:g}s.{seen} The run goes on through a Spark barrier "
        "allGather round; those nodes' rank output goes to the executors' stderr logs and they are "
        "stopped by Spark alone. Fix: make that address reachable from the executors (set "
        "spark.driver.host, or SPARK_TORCH_CHANNEL_HOST, to an address of the driver the executors can "
        "reach; with a firewall, open a port range and set SPARK_TORCH_CHANNEL_PORTS or "
        "spark.torch.channel.ports to it). See docs/troubleshooting.md"
    )
