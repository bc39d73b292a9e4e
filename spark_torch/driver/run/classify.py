"""One classifier for both modes: how an attempt ended, from what its nodes said and what the
driver did.

Local and distributed mode each gather the same :class:`AttemptEvidence`: every node's
:class:`~spark_torch.shared.node_outcome.NodeOutcome` (in-process in local mode; sealed, over the
channel, in the task's rows or in Spark's error text in distributed mode), the driver's own
verdict when it stopped the attempt (the user's interrupt, a stall, the timeout), the grow request
it acted on, the Spark job's own error and how to read rank 0's result. :func:`classify` alone
decides what that means, in one order, as an :class:`AttemptOutcome` that keeps the nodes'
outcomes.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import ClassVar

from spark_torch.base.states import ProblemKind, StopReason
from spark_torch.driver.result import GrowRequest
from spark_torch.driver.run.failures import classify_spark_text, without_reports
from spark_torch.driver.run.outcome import (
    AttemptCause,
    AttemptOutcome,
    DriverStop,
    GrowRequested,
    Interrupted,
    RanksFailed,
    SparkJobFailed,
    Stacks,
    StartProblem,
    timed_out,
)
from spark_torch.errors import LaunchError
from spark_torch.shared.node_outcome import NodeOutcome, failures_of
from spark_torch.shared.rank_files import ResultBytes

__all__ = ["TimeUp", "Verdict", "AttemptEvidence", "classify"]


@dataclass(frozen=True)
class TimeUp:
    """The driver stopped the attempt because the run's ``timeout`` passed: what the message
    about the ranks it found running needs."""

    run_timeout: float | None
    #: each node's global ranks
    node_ranks: Mapping[int, range]
    #: a rank's last output lines
    last_lines: Callable[[int], tuple[str, ...]]
    stacks: Stacks = field(default_factory=Stacks)
    #: local mode: the driver's host (the ranks ran there)
    host: str | None = None
    #: leads the message's account of the stopped ranks
    note: str = ""
    reason: ClassVar[StopReason] = StopReason.TIMEOUT


#: what the driver did to a running attempt: stopped it for a :class:`StopReason` (the user's
#: interrupt, the timeout; a stall, report()'s deadlock or any other reason as a
#: :class:`DriverStop`, its end read from ``STOP_ENDS``); None when the attempt ended by itself
Verdict = Interrupted | DriverStop | TimeUp | None


@dataclass(frozen=True)
class AttemptEvidence:
    """What an attempt left, gathered by its mode."""

    #: how many nodes the attempt had
    nodes: int
    #: each node's outcome, as the node said (a node that said nothing is missing)
    outcomes: Mapping[int, NodeOutcome] = field(default_factory=dict)
    verdict: Verdict = None
    #: elastic_grow: free slots were found and the nodes stopped after a checkpoint
    grow: GrowRequest | None = None
    #: distributed mode: the barrier job failed by itself (a node raised, or Spark gave up)
    spark_error: BaseException | None = None
    #: rank 0's pickled value (None for scripts), read only once every node finished; raises
    #: :class:`~spark_torch.errors.LaunchError` when it did not arrive whole
    result: Callable[[], ResultBytes | None] = lambda: None
    #: the attempt's input was a DataFrame (a stage that ran no task had no rows to give)
    dataframe: bool = False
    #: distributed mode: the nodes whose task returned (its rows arrived through Spark); a node
    #: that said over the channel that it finished but whose rows never came did not complete
    #: (None: every node's, local mode)
    returned: Collection[int] | None = None


def _completed(evidence: AttemptEvidence) -> int:
    """How many nodes finished and returned."""
    returned = evidence.returned
    return sum(
        outcome.finished and (returned is None or node in returned) for node, outcome in evidence.outcomes.items()
    )


def _failed(evidence: AttemptEvidence) -> AttemptCause | None:
    """The nodes' failed ranks, or a node's problem when the job failed by itself, or what Spark's
    text says when no node said anything; None when nothing failed."""
    nodes = [evidence.outcomes[node] for node in sorted(evidence.outcomes)]
    failures, pickled = failures_of(nodes)
    spark_error = evidence.spark_error
    if failures:
        return RanksFailed(failures, pickled, spark_error)
    if spark_error is None:
        return None
    problem = next((outcome.problem for outcome in nodes if outcome.problem is not None), None)
    if problem is not None:
        return StartProblem(problem, spark_error=spark_error)
    kind, detail = classify_spark_text(without_reports(str(spark_error)))
    return SparkJobFailed(kind, detail, spark_error=spark_error)


def classify(evidence: AttemptEvidence) -> AttemptOutcome:
    """How the attempt ended, in this order: the user's interrupt; growing; ranks that failed, or
    a job that failed by itself (it failed even after every node said it finished: rank 0's
    result may be what Spark refused); every node finished and returned (also while being
    stopped: a completed run is not a stopped one); the driver's stop (stall, timeout, a
    cancellation from another thread), naming only the ranks the nodes found still running; a
    node's problem; nodes that never said how they ended. The outcome keeps the nodes' outcomes."""
    cause = _cause(evidence)
    nodes = dict(evidence.outcomes)
    if cause is None:
        try:
            return AttemptOutcome.succeeded(evidence.result(), nodes)
        except LaunchError as exc:  # rank 0's result did not arrive whole
            cause = StartProblem.of(ProblemKind.LAUNCH, str(exc), cause=exc.__cause__)
    return AttemptOutcome.ended(cause, nodes)


def _cause(evidence: AttemptEvidence) -> AttemptCause | None:
    """Why the attempt did not succeed (see :func:`classify`), None when it did."""
    verdict = evidence.verdict
    if isinstance(verdict, Interrupted) and isinstance(verdict.interrupt, KeyboardInterrupt):
        return verdict
    if verdict is None and evidence.grow is not None:
        return GrowRequested(evidence.grow)
    failed = _failed(evidence)
    if failed is not None:
        return failed
    if _completed(evidence) >= evidence.nodes:
        return None
    if isinstance(verdict, TimeUp):
        ranks = {node: verdict.node_ranks[node] for node in verdict.node_ranks}
        return timed_out(
            verdict.run_timeout,
            evidence.outcomes,
            ranks,
            verdict.last_lines,
            verdict.stacks,
            verdict.host,
            verdict.note,
        )
    if verdict is not None:
        return verdict
    problem = next(
        (evidence.outcomes[n].problem for n in sorted(evidence.outcomes) if evidence.outcomes[n].problem), None
    )
    if problem is not None:
        return StartProblem(problem)
    if evidence.dataframe and not evidence.outcomes:
        return StartProblem.of(ProblemKind.CONFIGURATION, "the DataFrame is empty; there is nothing to train on")
    return StartProblem.of(
        ProblemKind.LAUNCH,
        f"only {_completed(evidence)} of {evidence.nodes} Spark barrier tasks reported back; check the executor logs",
    )
