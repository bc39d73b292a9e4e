"""Elastic membership: how many nodes an attempt runs, between ``min_processes`` and
``num_processes``, from the slots the cluster has now.

Ranks come and go in whole nodes (a node is one barrier task with its ranks). The first attempt
starts with every node when the slots are there, else at once with as many as fit if that is at
least the minimum (below it, it waits up to ``executor_wait`` for executors to register); every restart asks for all
nodes again, waiting up to the
``elastic_wait`` setting for lost executors to come back, then goes on with what there is. With
``elastic_grow``, an attempt below full size that sees slots for more nodes free for
``elastic_wait`` seconds ends at its next checkpoint and the run restarts larger
(:class:`GrowWatch`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from spark_torch.base.states import StopReason
from spark_torch.driver.result import AttemptSize, GrowRequest, SizeReason
from spark_torch.driver.spark.cluster import available_slots, master_of
from spark_torch.driver.spark.slots import can_wait, check_slots, wait_for_slots
from spark_torch.errors import InsufficientSlotsError

__all__ = ["Membership", "GrowWatch"]

logger = logging.getLogger(__name__)

#: how often a grow watch asks for the slots
WATCH_SECONDS = 1.0


@dataclass(frozen=True)
class Membership:
    """The sizes a run may take: nodes of ``procs_per_node`` ranks each."""

    max_nodes: int
    min_nodes: int
    procs_per_node: int
    #: how long a restart waits for lost executors; how long free slots must last to grow
    elastic_wait: float
    #: how long the first attempt waits for executors to register
    executor_wait: float

    @property
    def elastic(self) -> bool:
        """Whether the size may change at all."""
        return self.min_nodes < self.max_nodes

    def size(self, nodes: int, reason: SizeReason) -> AttemptSize:
        """An attempt of ``nodes`` nodes, for ``reason``."""
        return AttemptSize(reason, nodes, self.max_nodes, self.procs_per_node)

    def nodes_for(self, spark: Any, first: bool) -> AttemptSize:
        """The next attempt's nodes, and why that many (for the user); raises
        :class:`InsufficientSlotsError` below the minimum."""
        every = SizeReason.ALL_NODES if first else SizeReason.ALL_NODES_AGAIN
        if not self.elastic:
            check_slots(spark, self.max_nodes, self.executor_wait)
            return self.size(self.max_nodes, every)
        slots = available_slots(spark)
        if slots is None:  # unknown (dynamic allocation): ask for everything, Spark decides
            return self.size(self.max_nodes, SizeReason.SLOTS_UNKNOWN)
        if can_wait(spark):
            if not first and slots < self.max_nodes:  # lost executors may come back (restarted)
                slots = wait_for_slots(spark, self.max_nodes, self.elastic_wait)
            if slots is not None and slots < self.min_nodes:  # executors still registering
                slots = wait_for_slots(spark, self.min_nodes, self.executor_wait)
        if slots is None or slots >= self.max_nodes:
            return self.size(self.max_nodes, every)
        if slots < self.min_nodes:
            raise InsufficientSlotsError(
                f"distributed mode needs at least {self.min_nodes * self.procs_per_node} ranks (min_processes; "
                f"num_processes={self.max_nodes * self.procs_per_node}), one barrier task per node of "
                f"{self.procs_per_node} rank(s), but the cluster ({master_of(spark)}) has slots for {slots} "
                "node(s). Lower min_processes, add executors/cores, lower spark.task.cpus, or use local_mode=True"
            )
        size = self.size(slots, SizeReason.FEWER_SLOTS)
        logger.warning(
            "spark_torch: starting with %d of %d ranks (min_processes=%d): the cluster has slots for %d of %d nodes",
            size.ranks,
            size.max_ranks,
            self.min_nodes * self.procs_per_node,
            slots,
            self.max_nodes,
        )
        return size


class GrowWatch:
    """While an attempt runs below full size: notices slots for more nodes that stay free for
    ``wait`` seconds; :meth:`checkpointed` then stops the attempt (through ``stop``) right after a
    step with a checkpoint was persisted."""

    def __init__(self, spark: Any, running: int, membership: Membership, stop: Callable[[StopReason], None]) -> None:
        self._spark = spark
        self._running = running
        self._membership = membership
        self._stop_nodes = stop
        self._since: float | None = None
        self._closed = threading.Event()
        self.ready = threading.Event()
        #: set once the attempt was stopped to grow: why
        self.requested: GrowRequest | None = None
        self._thread = threading.Thread(target=self._watch, name="spark-torch-grow-watch", daemon=True)
        self._thread.start()

    def _target(self) -> int:
        slots = available_slots(self._spark) or 0
        return min(self._membership.max_nodes, slots)  # our own tasks hold `running` of them

    def _watch(self) -> None:
        while not self._closed.wait(WATCH_SECONDS):
            try:
                more = self._target() > self._running
            except Exception:  # noqa: BLE001 - a session being stopped: stop watching
                return
            now = time.monotonic()
            if not more:
                self._since = None
                self.ready.clear()
            elif self._since is None:
                self._since = now
            elif now - self._since >= self._membership.elastic_wait:
                self.ready.set()

    def checkpointed(self, step: int) -> None:
        """A step with a checkpoint is persisted (and answered): grow now if it is time."""
        if self.requested is None and self.ready.is_set():
            self.requested = GrowRequest(self._running, self._target(), self._membership.elastic_wait, step)
            logger.warning("spark_torch: %s", self.requested)
            self._stop_nodes(StopReason.GROW)

    def close(self) -> None:
        """Stop watching."""
        self._closed.set()
        self._thread.join(WATCH_SECONDS * 2)
