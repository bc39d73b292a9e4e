"""One classifier for both modes: how an attempt ended, from what its nodes said and what the
driver did.

Local and distributed mode each gather the same :class:`AttemptEvidence`: every node's
:class:`~spark_torch.base.states.NodeOutcome` (in-process in local mode; over the channel and in
the task's rows in distributed mode), the driver's own verdict when it stopped the attempt (the
user's interrupt, a stall, the timeout, growing), a failure cause the mode found (the nodes'
authenticated failure reports, Spark's job error) and how to read rank 0's result. :func:`classify`
alone decides what that means, in one order, as an :class:`AttemptOutcome`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field

from spark_torch.base.states import NodeOutcome, ProblemKind
from spark_torch.driver.run.outcome import (
    AttemptCause,
    AttemptOutcome,
    DriverProblem,
    GrowRequested,
    Interrupted,
    RanksFailed,
    Stacks,
    StallVerdict,
    timed_out,
)
from spark_torch.errors import LaunchError
from spark_torch.shared.failure_reports import FailureReport
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


#: what the driver did to a running attempt: stopped it (interrupt, stall, timeout) or asked it to
#: grow; None when the attempt ended by itself
Verdict = Interrupted | StallVerdict | TimeUp | GrowRequested | None


@dataclass(frozen=True)
class AttemptEvidence:
    """What an attempt left, gathered by its mode."""

    #: how many nodes the attempt had
    nodes: int
    #: each node's outcome, as the node said (a node that said nothing is missing)
    outcomes: Mapping[int, NodeOutcome] = field(default_factory=dict)
    verdict: Verdict = None
    #: a failure the mode found: the nodes' authenticated reports, or Spark's job error
    failure: AttemptCause | None = None
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


def _problem(outcomes: Mapping[int, NodeOutcome]) -> FailureReport | None:
    """The first node problem the outcomes name, as the report the user's error is made of."""
    for node in sorted(outcomes):
        problem = outcomes[node].problem
        if problem is not None:
            return FailureReport(problem=problem)
    return None


def classify(evidence: AttemptEvidence) -> AttemptOutcome:
    """How the attempt ended, in this order: the user's interrupt; growing; the failure the mode
    found (a job that failed by itself failed, even after every node said it finished: rank 0's
    result may be what Spark refused); every node finished and returned (also while being
    stopped: a completed run is not a stopped one); the driver's stop (stall, timeout, a
    cancellation from another thread), naming only the ranks the nodes found still running; a
    node's problem; nodes that never said how they ended."""
    verdict = evidence.verdict
    if isinstance(verdict, Interrupted) and isinstance(verdict.interrupt, KeyboardInterrupt):
        return AttemptOutcome.ended(verdict)
    if isinstance(verdict, GrowRequested):
        return AttemptOutcome.ended(verdict)
    if evidence.failure is not None:
        return AttemptOutcome.ended(evidence.failure)
    if _completed(evidence) >= evidence.nodes:
        try:
            return AttemptOutcome.succeeded(evidence.result())
        except LaunchError as exc:  # rank 0's result did not arrive whole
            return AttemptOutcome.ended(DriverProblem(ProblemKind.LAUNCH, str(exc), cause=exc.__cause__))
    if isinstance(verdict, TimeUp):
        ranks = {node: verdict.node_ranks[node] for node in verdict.node_ranks}
        cause = timed_out(
            verdict.run_timeout,
            evidence.outcomes,
            ranks,
            verdict.last_lines,
            verdict.stacks,
            verdict.host,
            verdict.note,
        )
        return AttemptOutcome.ended(cause)
    if verdict is not None:
        return AttemptOutcome.ended(verdict)
    problem = _problem(evidence.outcomes)
    if problem is not None:
        return AttemptOutcome.ended(RanksFailed(problem))
    finished = _completed(evidence)
    if evidence.dataframe and not evidence.outcomes:
        return AttemptOutcome.ended(
            DriverProblem(ProblemKind.CONFIGURATION, "the DataFrame is empty; there is nothing to train on")
        )
    return AttemptOutcome.ended(
        DriverProblem(
            ProblemKind.LAUNCH,
            f"only {finished} of {evidence.nodes} Spark barrier tasks reported back; check the executor logs",
        )
    )
