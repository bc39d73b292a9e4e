"""The states an attempt's parts pass through, as types: a rank's state, a node's rank group's,
why a node's ranks were stopped, what kind of problem kept a node from starting them, and how a
node's part ended (:class:`NodeOutcome`, the one value that crosses the node-to-driver seam).

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

__all__ = [
    "ValueEnum",
    "RankState",
    "GroupState",
    "StopReason",
    "ProblemKind",
    "StopSignal",
    "ShardSource",
    "ShardUse",
    "NodeOutcome",
]


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


class GroupState(ValueEnum):
    """How a node's ranks ended, together."""

    #: every rank exited with code 0 (and rank 0, when it ran here, wrote its result)
    SUCCEEDED = "succeeded"
    #: a rank failed; the others were stopped
    FAILED = "failed"
    #: stopped from outside (the driver's stop: timeout, stall, cancel, another node's failure)
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


class ShardSource(ValueEnum):
    """Where one node's DataFrame rows came from (``run_on_dataframe``)."""

    #: staged from the input and kept (``reuse_staged``)
    KEPT = "kept"
    #: staged from the input into the run's scratch directory only
    PRIVATE = "private"
    #: a shard an earlier run kept
    REUSED = "reused"
    #: kept shards did not cover every node: no rank started
    MISSED = "missed"


@dataclass(frozen=True)
class ShardUse:
    """One node's rows for this attempt: which shard, how many rows, where they came from."""

    shard: int
    rows: int
    source: ShardSource


#: bounds on the dump paths a node's end carries per rank (a path longer than this is cut)
MAX_DUMPS, MAX_DUMP_PATH = 8, 4096
#: bound on a node problem's message as it travels
MAX_PROBLEM = 8 * 1024


@dataclass(frozen=True)
class NodeOutcome:
    """How one node's part of an attempt ended: the one value a node gives the driver, in both
    modes (returned in-process in local mode; over the channel and in the task's rows in
    distributed mode), parsed by :meth:`from_wire` alone.

    ``state`` is the rank group's (None: no rank started, because the node was stopped before or
    had a ``problem``), ``ranks`` each rank's last state, ``stop`` the stop reason the node acted
    on (None: not stopped, or a reason this version does not know), ``dumps`` per rank the files
    torch wrote about it on the node (the NCCL watchdog's), ``problem`` what kept the node from
    starting its ranks: the kind of error and its message."""

    state: GroupState | None = None
    ranks: Mapping[int, RankState] = field(default_factory=dict)
    stop: StopReason | None = None
    dumps: Mapping[int, tuple[str, ...]] = field(default_factory=dict)
    problem: tuple[ProblemKind, str] | None = None
    #: ``run_on_dataframe``: where the node's rows came from
    shard: ShardUse | None = None

    @property
    def finished(self) -> bool:
        """Whether every rank of the node finished."""
        return self.state is GroupState.SUCCEEDED

    def to_wire(self) -> dict[str, Any]:
        """The message body (JSON-able)."""
        return {
            "state": None if self.state is None else self.state.value,
            "ranks": {str(rank): state.value for rank, state in self.ranks.items()},
            "stop": None if self.stop is None else self.stop.value,
            "dumps": {str(rank): list(paths) for rank, paths in self.dumps.items()},
            "problem": None if self.problem is None else [self.problem[0].value, self.problem[1][:MAX_PROBLEM]],
            "shard": None if self.shard is None else [self.shard.shard, self.shard.rows, self.shard.source.value],
        }

    @classmethod
    def from_wire(cls, value: object) -> NodeOutcome:
        """Parse a message body; raises ``ValueError`` for anything but what :meth:`to_wire` makes
        (a stop reason this version does not know reads as None)."""
        if not isinstance(value, dict) or not isinstance(value.get("ranks"), dict):
            raise ValueError("a node's outcome needs an object with its ranks' states")
        state = value.get("state")
        ranks = {int(rank): RankState(rank_state) for rank, rank_state in value["ranks"].items()}
        stop = value.get("stop")
        dumps = {} if value.get("dumps") is None else value["dumps"]
        if not isinstance(dumps, dict) or not all(
            isinstance(paths, list) and all(isinstance(p, str) for p in paths) for paths in dumps.values()
        ):
            raise ValueError("a node's dumps need an object of lists of paths by rank")
        problem = value.get("problem")
        if problem is not None and (
            not isinstance(problem, list) or len(problem) != 2 or not isinstance(problem[1], str)
        ):
            raise ValueError("a node's problem must be [kind, message]")
        shard = value.get("shard")
        if shard is not None and (
            not isinstance(shard, list) or len(shard) != 3 or not all(type(n) is int and n >= 0 for n in shard[:2])
        ):
            raise ValueError("a node's shard must be [shard, rows, source]")
        return cls(
            state=None if state is None else GroupState(state),
            ranks=ranks,
            stop=None if stop is None else StopReason.parse(stop),
            dumps={int(rank): tuple(p[:MAX_DUMP_PATH] for p in paths[:MAX_DUMPS]) for rank, paths in dumps.items()},
            problem=None if problem is None else (ProblemKind(problem[0]), problem[1][:MAX_PROBLEM]),
            shard=None if shard is None else ShardUse(shard[0], shard[1], ShardSource(shard[2])),
        )
