"""How an attempt ended, as data: what both modes return and the controller decides on.

Every way an attempt ends is an :class:`AttemptOutcome`: its :class:`AttemptEnd`, rank 0's
pickled value when it succeeded, otherwise one typed cause that carries what the user's error
will need (the nodes' failed ranks, a problem that kept the ranks from starting, Spark's own
exception, the ranks that were stopped and where they were, a stall's verdict, the user's
interrupt), and every node's :class:`~spark_torch.shared.node_outcome.NodeOutcome`, the evidence
per-node facts are read from (:attr:`AttemptOutcome.shards`). A cause the driver's stop made
(:class:`RanksStopped`, :class:`DriverStop`, :class:`Interrupted`, :class:`GrowRequested`) has
its :class:`StopReason`, and its end is that reason's row of
:data:`~spark_torch.driver.attempts.STOP_ENDS`; a new stop reason that carries no more than what
to say and where the ranks were is a :class:`DriverStop`, no new cause. No exception is built
on the way: :func:`spark_torch.driver.run.failures.attempt_error` turns a cause into the
user's exception, in one place, at the controller's edge.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import ClassVar

from spark_torch.base.states import Problem, ProblemKind, RankState, ShardUse, StopReason, ValueEnum
from spark_torch.driver.attempts import STOP_ENDS, AttemptEnd, GrowRequest
from spark_torch.errors import RankFailure, StoppedRank
from spark_torch.shared.node_outcome import NodeOutcome
from spark_torch.shared.rank_files import ResultBytes
from spark_torch.shared.staged_shards import Staging

__all__ = [
    "AttemptOutcome",
    "AttemptCause",
    "RanksFailed",
    "SparkJobFailed",
    "SparkFailureKind",
    "StartProblem",
    "RanksStopped",
    "DriverStop",
    "Interrupted",
    "GrowRequested",
    "Stacks",
    "still_running",
    "timed_out",
]

_PROBLEM_ENDS = {
    ProblemKind.LAUNCH: AttemptEnd.LAUNCH_FAILED,
    ProblemKind.CONFIGURATION: AttemptEnd.MISCONFIGURED,
    ProblemKind.SLOTS: AttemptEnd.MISCONFIGURED,
}


@dataclass(frozen=True)
class Stacks:
    """Where each rank was when the attempt was stopped: ``{rank: text}`` and the grouped text."""

    by_rank: dict[int, str] = field(default_factory=dict)
    text: str | None = None


@dataclass(frozen=True)
class RanksFailed:
    """Ranks failed: every node's failed ranks, as their outcomes said (sealed with the run's
    secret, or in this process), and their pickled exceptions."""

    failures: tuple[RankFailure, ...]
    #: per failed rank, its exception as a base64 pickle (trusted: the outcome was authenticated)
    pickled: Mapping[int, str] = field(default_factory=dict)
    #: distributed mode: the Spark job's own exception (the user's error names it as its cause)
    spark_error: BaseException | None = None

    @property
    def end(self) -> AttemptEnd:
        return AttemptEnd.FAILED


class SparkFailureKind(ValueEnum):
    """What a failed barrier job's text says went wrong when no node could report."""

    #: Spark's Python worker could not import a module spark_torch needs (``detail``: its name)
    MISSING_MODULE = "missing module"
    #: the barrier stage needs more slots than the cluster has
    TOO_FEW_SLOTS = "too few slots"
    #: an executor was lost (``detail``: Spark's line)
    EXECUTOR_LOST = "executor lost"
    #: rank 0's result is over ``spark.driver.maxResultSize``
    RESULT_TOO_LARGE = "result too large"
    #: anything else (``detail``: the first line of Spark's text)
    OTHER = "other"


_SPARK_ENDS = {
    SparkFailureKind.MISSING_MODULE: AttemptEnd.LAUNCH_FAILED,
    SparkFailureKind.TOO_FEW_SLOTS: AttemptEnd.MISCONFIGURED,
    SparkFailureKind.EXECUTOR_LOST: AttemptEnd.FAILED,
    SparkFailureKind.RESULT_TOO_LARGE: AttemptEnd.FAILED,
    SparkFailureKind.OTHER: AttemptEnd.LAUNCH_FAILED,
}


@dataclass(frozen=True)
class SparkJobFailed:
    """The barrier job failed and no node reported: what Spark's text says, and its exception."""

    kind: SparkFailureKind
    detail: str
    spark_error: BaseException

    @property
    def end(self) -> AttemptEnd:
        return _SPARK_ENDS[self.kind]


@dataclass(frozen=True)
class StartProblem:
    """A problem kept the attempt's ranks from starting, found by a node (its outcome's
    ``problem``: shards, a missing script, GPUs, no rendezvous) or by the driver (too few task
    slots or executors whose Python cannot run a node, found before the attempt started; its
    channel's address, an empty DataFrame, tasks that did not report back)."""

    problem: Problem
    #: what the driver caught (an OSError binding the channel), kept as the error's cause
    cause: BaseException | None = None
    #: distributed mode: the Spark job's own exception, when a node's problem ended it
    spark_error: BaseException | None = None

    @classmethod
    def of(cls, kind: ProblemKind, message: str, cause: BaseException | None = None) -> StartProblem:
        """The driver's problem of ``kind``."""
        return cls(Problem(kind, message), cause)

    @property
    def end(self) -> AttemptEnd:
        return _PROBLEM_ENDS[self.problem.kind]


@dataclass(frozen=True)
class RanksStopped:
    """The run's ``timeout`` passed: the ranks that still ran were stopped."""

    #: the user's ``timeout``, for the message
    run_timeout: float | None
    #: the ranks that were still running, with their last lines
    ranks: tuple[StoppedRank, ...]
    #: what was stopped, for the message ("ranks 0, 1 were still running and stopped")
    what: str
    stacks: Stacks = field(default_factory=Stacks)
    reason: StopReason = StopReason.TIMEOUT

    @property
    def end(self) -> AttemptEnd:
        return STOP_ENDS[self.reason]


def timed_out(
    run_timeout: float | None,
    ends: Mapping[int, NodeOutcome],
    node_ranks: Mapping[int, range],
    last_lines: Callable[[int], tuple[str, ...]],
    stacks: Stacks,
    host: str | None = None,
    note: str = "",
) -> RanksStopped:
    """The cause of an attempt its ``timeout`` stopped, in both modes: the ranks the stop found
    running as their nodes' ends say (every rank of a node in ``node_ranks`` that did not say:
    it could not reach the driver), each with its last lines (``last_lines``) and the dumps its
    node found; ``note`` leads the message's account of them."""
    running = [
        rank
        for node, ranks in node_ranks.items()
        for rank in ranks
        if node not in ends or ends[node].ranks.get(rank) is RankState.STOPPED
    ]
    dumps = {rank: paths for end in ends.values() for rank, paths in end.dumps.items()}
    stopped = tuple(StoppedRank(rank, host, last_lines(rank), dumps.get(rank, ())) for rank in running)
    return RanksStopped(run_timeout, stopped, note + still_running(stopped), stacks)


def still_running(ranks: tuple[StoppedRank, ...]) -> str:
    """What a timeout stopped, for :attr:`RanksStopped.what` ("ranks 0, 1 were still running and stopped")."""
    numbers = [str(stopped.rank) for stopped in ranks]
    if not numbers:
        return "no rank was running (the ranks had not started yet, or had ended)"
    who = f"rank {numbers[0]} was" if len(numbers) == 1 else f"ranks {', '.join(numbers)} were"
    return f"{who} still running and stopped"


@dataclass(frozen=True)
class DriverStop:
    """The driver stopped the attempt for ``reason``, with what to tell the user and where the
    ranks were: the stall watch's stall (``stall_action="fail"``) or report() on some ranks only
    while the others wait in a collective (``REPORT_DEADLOCK``), or any other reason that needs
    no more."""

    reason: StopReason
    headline: str
    stacks: Stacks = field(default_factory=Stacks)

    @property
    def end(self) -> AttemptEnd:
        return STOP_ENDS[self.reason]


@dataclass(frozen=True)
class Interrupted:
    """The user interrupted the run; the interrupt (with where the ranks were) is re-raised."""

    interrupt: BaseException
    reason: ClassVar[StopReason] = StopReason.CANCELLED

    @property
    def end(self) -> AttemptEnd:
        return STOP_ENDS[self.reason]


@dataclass(frozen=True)
class GrowRequested:
    """Free slots were found and the ranks stopped after a checkpoint: restart larger."""

    request: GrowRequest
    reason: ClassVar[StopReason] = StopReason.GROW

    @property
    def end(self) -> AttemptEnd:
        return STOP_ENDS[self.reason]


#: why an attempt did not succeed: one of these, each carrying what the user's error needs
AttemptCause = RanksFailed | SparkJobFailed | StartProblem | RanksStopped | DriverStop | Interrupted | GrowRequested


@dataclass(frozen=True)
class AttemptOutcome:
    """How an attempt ended: its end, rank 0's pickled value when it succeeded, else its cause;
    ``nodes``: each node's outcome as the node said (the evidence it was classified from);
    ``staging``: how its DataFrame rows reached the ranks (``reuse_staged``), else None."""

    end: AttemptEnd
    result: ResultBytes | None = None
    cause: AttemptCause | None = None
    staging: Staging | None = None
    nodes: Mapping[int, NodeOutcome] = field(default_factory=dict)

    @classmethod
    def succeeded(cls, result: ResultBytes | None, nodes: Mapping[int, NodeOutcome] | None = None) -> AttemptOutcome:
        """The gang finished; ``result`` is rank 0's pickled value (None for scripts)."""
        return cls(AttemptEnd.SUCCEEDED, result=result, nodes=nodes or {})

    @classmethod
    def ended(cls, cause: AttemptCause, nodes: Mapping[int, NodeOutcome] | None = None) -> AttemptOutcome:
        """An attempt that did not succeed, its end read from its cause."""
        return cls(cause.end, cause=cause, nodes=nodes or {})

    @property
    def shards(self) -> dict[int, ShardUse]:
        """``run_on_dataframe``: where each node's rows came from, as its outcome says."""
        return {node: outcome.shard for node, outcome in self.nodes.items() if outcome.shard is not None}
