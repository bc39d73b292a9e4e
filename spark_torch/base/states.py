"""The states an attempt's parts pass through, as types: a rank's state, a node's rank group's,
why a node's ranks were stopped, and what kept an attempt's ranks from starting (:class:`Problem`:
its kind and its message, the one type for it). How a node's part ended, the one value that crosses
the node-to-driver seam, is :class:`~spark_torch.shared.node_outcome.NodeOutcome` (it carries the
ranks' failures, which are :mod:`spark_torch.errors`' types).

A leaf module (no imports from the rest of the package): the node runner, the channel and the
driver all speak these. Each is a ``str`` enum whose value is what travels (over the channel, in
a node's end) and what the console prints, so a value read from the wire is checked by
constructing the enum (``RankState("failed")``; an unknown value raises ``ValueError``).
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass

__all__ = [
    "ValueEnum",
    "RankState",
    "GroupState",
    "StopReason",
    "ProblemKind",
    "StopSignal",
    "ShardSource",
    "ShardUse",
    "Problem",
    "MAX_PROBLEM",
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


#: bound on a problem's message as it travels
MAX_PROBLEM = 8 * 1024


@dataclass(frozen=True)
class Problem:
    """What kept an attempt's ranks from starting, found by a node or by the driver's checks: the
    kind of error the user gets and what to tell them (the one ``(kind, message)`` type)."""

    kind: ProblemKind
    message: str

    def to_wire(self) -> list[str]:
        """``[kind, message]`` (the message within :data:`MAX_PROBLEM`)."""
        return [self.kind.value, self.message[:MAX_PROBLEM]]

    @classmethod
    def from_wire(cls, value: object) -> Problem:
        """Inverse of :meth:`to_wire`; raises ``ValueError`` for anything else."""
        if not isinstance(value, list) or len(value) != 2 or not isinstance(value[1], str):
            raise ValueError("a problem must be [kind, message]")
        return cls(ProblemKind(value[0]), value[1][:MAX_PROBLEM])
