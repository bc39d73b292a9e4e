"""What one node's rank group ends with (the shape of torch elastic's ``RunResult``): the group's
state and every rank's status, and how that becomes the node's
:class:`~spark_torch.shared.node_outcome.NodeOutcome`. Made by :mod:`spark_torch.node.rank_group`."""

from __future__ import annotations

from dataclasses import dataclass, field

from spark_torch.base.states import GroupState, RankState, StopReason
from spark_torch.errors import RankFailure
from spark_torch.shared.node_outcome import NodeOutcome

__all__ = ["RankStatus", "GroupResult"]


@dataclass(frozen=True)
class RankStatus:
    """One rank of the node at the end: its state, what it printed last, and for a failed
    rank what is known about the failure."""

    rank: int
    state: RankState
    last_lines: tuple[str, ...] = ()
    started_at: float = 0.0
    failure: RankFailure | None = None
    #: for a rank stopped from outside, what torch wrote about it (its NCCL watchdog's dump)
    dumps: tuple[str, ...] = ()


@dataclass(frozen=True)
class GroupResult:
    """What happened on one node (the shape of torch elastic's ``RunResult``): the group's state
    and every rank's status."""

    state: GroupState
    ranks: tuple[RankStatus, ...] = ()
    #: rank 0's pickled return value, inside the node's workdir (gone when the workdir is)
    result_file: str | None = None
    #: per failed rank, its pickled exception (base64) when it wrote one
    pickled: dict[int, str | None] = field(default_factory=dict)
    #: why the group was stopped from outside, as the node's stop said (None: not stopped, or unknown)
    stop_reason: StopReason | None = None

    def outcome(self) -> NodeOutcome:
        """What the node tells the driver about how its ranks ended (the failed ranks included)."""
        return NodeOutcome(
            self.state,
            {status.rank: status.state for status in self.ranks},
            self.stop_reason,
            {status.rank: status.dumps for status in self.ranks if status.dumps},
            failures=self.failures,
            pickled={rank: blob for rank, blob in self.pickled.items() if blob},
        )

    @property
    def failures(self) -> tuple[RankFailure, ...]:
        """The failed ranks' failures (the first that failed here; rank 0 without its result)."""
        return tuple(status.failure for status in self.ranks if status.failure is not None)

    def still_running(self) -> tuple[RankStatus, ...]:
        """The ranks that were still running when the group was stopped from outside."""
        if self.state is not GroupState.STOPPED:
            return ()
        return tuple(status for status in self.ranks if status.state is RankState.STOPPED)
