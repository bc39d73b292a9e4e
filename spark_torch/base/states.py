"""The states an attempt's parts pass through, as types: a rank's state, why a node's ranks were
stopped, and what kind of problem kept a node from starting them.

A leaf module (no imports from the rest of the package): the node runner, the channel and the
driver all speak these. Each is a ``str`` enum whose value is what travels (over the channel, in
a failure report) and what the console prints, so a value read from the wire is checked by
constructing the enum (``RankState("failed")``; an unknown value raises ``ValueError``).
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ValueEnum", "RankState", "StopReason", "ProblemKind", "StopSignal", "NodeEnd"]


class ValueEnum(str, enum.Enum):
    """A ``str`` enum whose ``str()`` is its value: the word that travels and is printed."""

    def __str__(self) -> str:
        return str(self.value)


class RankState(ValueEnum):
    """Where one rank process is (the live status counts them; a node's result records the last)."""

    #: the process was started
    STARTED = "started"
    #: it exited with code 0
    FINISHED = "finished"
    #: it exited with another code or a signal, by itself
    FAILED = "failed"
    #: spark_torch stopped it (a timeout, a stall, a cancel, another rank's failure, growing)
    STOPPED = "stopped"


class StopReason(ValueEnum):
    """Why the driver stopped an attempt's ranks before they ended by themselves."""

    #: the run's ``timeout`` passed
    TIMEOUT = "timeout"
    #: no rank made progress for ``stall_timeout`` and ``stall_action="fail"``
    STALLED = "stalled"
    #: report() was called on some ranks while the others waited in a collective
    REPORT_DEADLOCK = "report deadlock"
    #: the user interrupted the run (Ctrl-C, a notebook's stop button)
    CANCELLED = "cancelled"
    #: a rank of another node failed: this node's ranks cannot go on
    PEER_FAILED = "peer failed"
    #: elastic_grow: more slots are free, the gang restarts larger after a checkpoint
    GROW = "grow"

    @classmethod
    def parse(cls, value: object) -> StopReason | None:
        """The reason a stop message names, or None for one this version does not know."""
        try:
            return cls(value)
        except ValueError:
            return None


class ProblemKind(ValueEnum):
    """What kind of problem kept an attempt's ranks from starting (found by a node, or by the
    driver's checks before the attempt): the name of the error the user gets."""

    #: the ranks could not be started (a missing script, another interpreter, no rendezvous)
    LAUNCH = "LaunchError"
    #: the run's input or settings make it impossible (shards, a storage not visible, GPUs)
    CONFIGURATION = "ConfigurationError"
    #: the cluster has fewer task slots than the attempt's nodes need (the driver's check)
    SLOTS = "InsufficientSlotsError"


class StopSignal(threading.Event):
    """The driver's stop as a node holds it: an event that also keeps why (the first reason
    given; None for a reason this version does not know). The rank group waits on it and
    reports the reason it acted on."""

    def __init__(self) -> None:
        super().__init__()
        self._reason: StopReason | None = None
        self._reason_lock = threading.Lock()

    def request(self, reason: StopReason | None) -> None:
        """Stop, because of ``reason`` (a later request keeps the first reason)."""
        with self._reason_lock:
            if not self.is_set():
                self._reason = reason
            self.set()

    @property
    def reason(self) -> StopReason | None:
        """Why the stop was requested (None: not requested, or a reason unknown here)."""
        with self._reason_lock:
            return self._reason


#: bounds on the dump paths a node's end carries per rank (a path longer than this is cut)
MAX_DUMPS, MAX_DUMP_PATH = 8, 4096


@dataclass(frozen=True)
class NodeEnd:
    """How a node's ranks ended, as the node tells the driver over the channel: each rank's last
    state and the stop reason the node acted on (None: its ranks were not stopped)."""

    ranks: Mapping[int, RankState] = field(default_factory=dict)
    stop: StopReason | None = None
    #: per rank, the files torch wrote about it on the node (the NCCL watchdog's dump), when any
    dumps: Mapping[int, tuple[str, ...]] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        """The message body (JSON-able)."""
        return {
            "ranks": {str(rank): state.value for rank, state in self.ranks.items()},
            "stop": None if self.stop is None else self.stop.value,
            "dumps": {str(rank): list(paths) for rank, paths in self.dumps.items()},
        }

    @classmethod
    def from_wire(cls, value: object) -> NodeEnd:
        """Parse a message body; raises ``ValueError`` for anything but what :meth:`to_wire` makes
        (a stop reason this version does not know reads as None)."""
        if not isinstance(value, dict) or not isinstance(value.get("ranks"), dict):
            raise ValueError("a node's end needs an object with its ranks' states")
        ranks = {int(rank): RankState(state) for rank, state in value["ranks"].items()}
        stop = value.get("stop")
        dumps = {} if value.get("dumps") is None else value["dumps"]
        if not isinstance(dumps, dict) or not all(
            isinstance(paths, list) and all(isinstance(p, str) for p in paths) for paths in dumps.values()
        ):
            raise ValueError("a node's dumps need an object of lists of paths by rank")
        return cls(
            ranks=ranks,
            stop=None if stop is None else StopReason.parse(stop),
            dumps={int(rank): tuple(p[:MAX_DUMP_PATH] for p in paths[:MAX_DUMPS]) for rank, paths in dumps.items()},
        )
