"""One attempt of a run as the driver records it: why it started, its size, how it ended
(:class:`AttemptRecord`, in ``RunResult.attempts``), and the values it is made of.

What an end means is declared here once, in two tables: :data:`END_RULES` says for each
:class:`AttemptEnd` what follows it (finish, restart without using up ``max_restarts``, restart
while restarts are left, raise: the restart policy reads it), why the next attempt starts, whether
it is an error and how the ``run()`` call ended when it is the last; :data:`STOP_ENDS` says for
each :class:`~spark_torch.base.states.StopReason` the end of an attempt the driver stopped for it.
A new stop reason is its word in ``base/states.py`` and its row of :data:`STOP_ENDS` (for a new
end also the :class:`AttemptEnd`, its row of :data:`END_RULES` and its restart's
:class:`AttemptReason`); the causes and verdicts of ``driver/run`` read its end here.

A past run's attempts come back from its log's rows (:func:`attempt_record`).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from spark_torch.base.states import StopReason, ValueEnum
from spark_torch.reporting.run_log import AttemptEndRow, Outcome, attempt_line

__all__ = [
    "AttemptEnd",
    "AttemptReason",
    "Follow",
    "EndRule",
    "END_RULES",
    "STOP_ENDS",
    "AttemptRecord",
    "AttemptSize",
    "SizeReason",
    "AttemptError",
    "GrowRequest",
    "attempt_record",
]


class AttemptEnd(ValueEnum):
    """How one attempt (one start of the whole gang) ended."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    TIMED_OUT = "timed out"
    STALLED = "stalled"
    GROW_REQUESTED = "grow requested"
    INTERRUPTED = "interrupted"
    #: the ranks could not be started (LaunchError: executors gone, the barrier stage refused)
    LAUNCH_FAILED = "launch failed"
    #: a setting or the cluster made the attempt impossible (ConfigurationError)
    MISCONFIGURED = "misconfigured"


class AttemptReason(ValueEnum):
    """Why an attempt started."""

    START = "start"
    RESTART_AFTER_FAILURE = "restart after a failure"
    RESTART_AFTER_STALL = "restart after a stall"
    GROW = "grow"


class Follow(ValueEnum):
    """What follows an attempt's end (:attr:`EndRule.follows`; the restart policy acts on it)."""

    #: the run is done: rank 0's value is returned
    FINISH = "finish"
    #: the gang restarts; ``max_restarts`` is not used up
    RESTART = "restart"
    #: the gang restarts while ``max_restarts`` allows, using one up; then the attempt's error is raised
    RESTART_COUNTED = "restart counted"
    #: the attempt's error is raised
    RAISE = "raise"


@dataclass(frozen=True)
class EndRule:
    """What an :class:`AttemptEnd` means (its row of :data:`END_RULES`)."""

    follows: Follow
    #: why the next attempt starts when this end restarts the gang (None: it never does)
    restart: AttemptReason | None = None
    #: how the ``run()`` call ended when it raised this end's error
    call: Outcome = Outcome.FAILED

    @property
    def error(self) -> bool:
        """Whether the end is an error (the user's exception, recorded with the attempt): every
        end the run may raise."""
        return self.follows in (Follow.RESTART_COUNTED, Follow.RAISE)


#: what each end means, declared once: what follows it, why the next attempt starts, the call's end
END_RULES: Mapping[AttemptEnd, EndRule] = MappingProxyType(
    {
        AttemptEnd.SUCCEEDED: EndRule(Follow.FINISH, call=Outcome.SUCCEEDED),
        AttemptEnd.FAILED: EndRule(Follow.RESTART_COUNTED, AttemptReason.RESTART_AFTER_FAILURE),
        AttemptEnd.STALLED: EndRule(Follow.RESTART_COUNTED, AttemptReason.RESTART_AFTER_STALL, Outcome.STALLED),
        AttemptEnd.GROW_REQUESTED: EndRule(Follow.RESTART, AttemptReason.GROW),
        # the run's time is up, the user asked to stop, or a restart would meet the same cluster and settings
        AttemptEnd.TIMED_OUT: EndRule(Follow.RAISE, call=Outcome.TIMED_OUT),
        AttemptEnd.INTERRUPTED: EndRule(Follow.RAISE, call=Outcome.INTERRUPTED),
        AttemptEnd.LAUNCH_FAILED: EndRule(Follow.RAISE),
        AttemptEnd.MISCONFIGURED: EndRule(Follow.RAISE),
    }
)

#: the end of an attempt the driver stopped, by the reason it stopped for (a peer's failure: the
#: end of the ranks that failed)
STOP_ENDS: Mapping[StopReason, AttemptEnd] = MappingProxyType(
    {
        StopReason.TIMEOUT: AttemptEnd.TIMED_OUT,
        StopReason.STALLED: AttemptEnd.STALLED,
        StopReason.REPORT_DEADLOCK: AttemptEnd.FAILED,
        StopReason.CANCELLED: AttemptEnd.INTERRUPTED,
        StopReason.PEER_FAILED: AttemptEnd.FAILED,
        StopReason.GROW: AttemptEnd.GROW_REQUESTED,
    }
)


class SizeReason(ValueEnum):
    """Why an attempt has the nodes it has (:class:`AttemptSize`, distributed mode)."""

    #: the run's first attempt: every node
    ALL_NODES = "all nodes"
    #: a restart: every node again
    ALL_NODES_AGAIN = "all nodes again"
    #: the cluster does not say how many slots it has (dynamic allocation): every node, Spark decides
    SLOTS_UNKNOWN = "slots unknown: all nodes"
    #: slots for fewer nodes than ``num_processes`` needs, at least ``min_processes``: as many as fit
    FEWER_SLOTS = "fewer slots"


@dataclass(frozen=True)
class AttemptSize:
    """The size of an attempt and why (distributed mode's elastic membership); ``str()`` says it
    in words, e.g. ``"2 of 3 ranks: slots for 2 of 3 nodes"``.

    Attributes:
        reason: why this many nodes (:class:`SizeReason`).
        nodes: the nodes (barrier tasks) of the attempt.
        max_nodes: the nodes of the full size (``num_processes``).
        procs_per_node: ranks per node.
    """

    reason: SizeReason
    nodes: int
    max_nodes: int
    procs_per_node: int

    @property
    def ranks(self) -> int:
        """The ranks of the attempt."""
        return self.nodes * self.procs_per_node

    @property
    def max_ranks(self) -> int:
        """The ranks of the full size (``num_processes``)."""
        return self.max_nodes * self.procs_per_node

    def __str__(self) -> str:
        if self.reason is SizeReason.FEWER_SLOTS:
            return f"{self.ranks} of {self.max_ranks} ranks: slots for {self.nodes} of {self.max_nodes} nodes"
        return str(self.reason)


@dataclass(frozen=True)
class AttemptError:
    """The error an attempt ended with, in short; ``str()`` is its first line (or its type's name).

    Attributes:
        type_name: the exception's class name (``"DistributedRunError"``, ``"RunStalledError"``...).
        first_line: the first line of its message (at most 300 characters; ``""`` when it has none).
    """

    type_name: str
    first_line: str = ""

    @classmethod
    def from_exception(cls, error: BaseException) -> AttemptError:
        """The short form of ``error``."""
        return cls(type(error).__name__, (str(error).splitlines() or [""])[0][:300])

    def __str__(self) -> str:
        return self.first_line or self.type_name


@dataclass(frozen=True)
class GrowRequest:
    """Why an attempt ended to grow (``elastic_grow``): slots for more nodes stayed free while it ran.

    Attributes:
        running: the nodes the attempt ran on.
        nodes: the nodes there were slots for (the next attempt's size, at most the full size).
        waited: how long the slots had been free, in seconds (the ``elastic_wait`` setting).
        step: the step whose checkpoint the attempt stopped after (the next one resumes from it).
    """

    running: int
    nodes: int
    waited: float
    step: int

    def __str__(self) -> str:
        return (
            f"slots for {self.nodes} nodes were free for {self.waited:g}s: growing from "
            f"{self.running} to {self.nodes} nodes after the checkpoint of step {self.step}"
        )


@dataclass
class AttemptRecord:
    """One attempt of a ``run()`` call, in ``RunResult.attempts``; ``str()`` says it all in one line.

    Attributes:
        attempt: this attempt's index in the run's history: 0 for the run's first start, then
            1, 2, ... (what ``report()`` rows call ``attempt``), counting on across ``run()``
            calls that resume the same ``run_id``.
        world_size: the ranks of this attempt.
        nodes: the nodes (barrier tasks) of this attempt; 1 in local mode.
        reason: why it started (:class:`AttemptReason`).
        size: why it had this size (:class:`AttemptSize`, distributed mode's elastic
            membership); None in local mode.
        end: how it ended (:class:`AttemptEnd`); None only while it runs.
        error: the error it ended with (:class:`AttemptError`: type name and first line), or None.
        grow: why it ended to grow (:class:`GrowRequest`), or None.
        replica_group: the replica group it was an attempt of (``replica_groups``), else None.
    """

    attempt: int
    world_size: int
    nodes: int
    reason: AttemptReason
    size: AttemptSize | None = None
    end: AttemptEnd | None = None
    error: AttemptError | None = None
    grow: GrowRequest | None = None
    replica_group: int | None = None

    @property
    def size_note(self) -> str:
        """``size`` in words, e.g. ``"2 of 3 ranks: slots for 2 of 3 nodes"`` (``""`` without one)."""
        return str(self.size) if self.size is not None else ""

    @property
    def detail(self) -> str | None:
        """``error`` or ``grow`` in words (the error's first line, or why it grew), or None."""
        why = self.error or self.grow
        return str(why) if why is not None else None

    def __str__(self) -> str:
        end = str(self.end) if self.end is not None else None
        line = attempt_line(
            self.attempt, self.world_size, self.nodes, str(self.reason), self.size_note, end, self.detail
        )
        return line if self.replica_group is None else f"replica group {self.replica_group}: {line}"


def attempt_record(row: AttemptEndRow) -> AttemptRecord:
    """An attempt of a past run, from its row in the run's log."""

    def member(kind: type[enum.Enum], value: str) -> Any:
        try:
            return kind(value)
        except ValueError:  # a newer writer's word: kept as text
            return value

    error = AttemptError(row.error_type, row.error or "") if row.error_type else None
    return AttemptRecord(
        attempt=row.attempt,
        world_size=row.world_size,
        nodes=row.nodes,
        reason=member(AttemptReason, row.reason),
        end=member(AttemptEnd, row.end),
        error=error,
    )
