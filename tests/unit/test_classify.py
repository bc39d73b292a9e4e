"""The one classifier of an attempt's end (both modes), and the node outcome rows it reads in
distributed mode (sealed with the run's secret, one parser)."""

from __future__ import annotations

from typing import Any

import pytest

from spark_torch.base.states import GroupState, Problem, ProblemKind, RankState, ShardSource, ShardUse, StopReason
from spark_torch.driver.result import AttemptEnd, GrowRequest
from spark_torch.driver.run.classify import AttemptEvidence, TimeUp, classify
from spark_torch.driver.run.outcome import (
    DriverStop,
    GrowRequested,
    Interrupted,
    RanksFailed,
    RanksStopped,
    SparkFailureKind,
    SparkJobFailed,
    Stacks,
    StartProblem,
)
from spark_torch.errors import LaunchError, RankFailure
from spark_torch.node import result_transfer
from spark_torch.shared.node_outcome import NodeOutcome

pytestmark = pytest.mark.unit

FINISHED = NodeOutcome(GroupState.SUCCEEDED, {0: RankState.FINISHED, 1: RankState.FINISHED})
SECRET = b"s" * 32


def _stopped(node: int, still: int) -> NodeOutcome:
    """Node ``node`` of two ranks each, stopped by the timeout while rank ``still`` ran."""
    first = 2 * node
    return NodeOutcome(
        GroupState.STOPPED,
        {rank: RankState.STOPPED if rank == still else RankState.FINISHED for rank in (first, first + 1)},
        StopReason.TIMEOUT,
    )


def _time_up() -> TimeUp:
    return TimeUp(5.0, {0: range(0, 2), 1: range(2, 4)}, lambda rank: (f"line of {rank}",), Stacks())


def _evidence(**fields: Any) -> AttemptEvidence:
    return AttemptEvidence(**{"nodes": 2, "result": lambda: b"rank 0's value", **fields})


def test_every_node_finished_is_success_even_while_being_stopped() -> None:
    outcome = classify(_evidence(outcomes={0: FINISHED, 1: FINISHED}, verdict=_time_up()))
    assert outcome.end is AttemptEnd.SUCCEEDED and outcome.result == b"rank 0's value"
    cancelled = Interrupted(RuntimeError("stopped: replica group 1 failed the run"))
    assert classify(_evidence(outcomes={0: FINISHED, 1: FINISHED}, verdict=cancelled)).end is AttemptEnd.SUCCEEDED


def test_a_timeout_names_only_the_ranks_still_running() -> None:
    outcome = classify(_evidence(outcomes={0: _stopped(0, 1), 1: _stopped(1, 2)}, verdict=_time_up()))
    assert isinstance(outcome.cause, RanksStopped) and outcome.end is AttemptEnd.TIMED_OUT
    assert [r.rank for r in outcome.cause.ranks] == [1, 2]
    assert outcome.cause.ranks[0].last_lines == ("line of 1",)
    # a node that never said how it ended: each of its ranks may still have been running
    silent = classify(_evidence(outcomes={0: _stopped(0, 1)}, verdict=_time_up()))
    assert isinstance(silent.cause, RanksStopped) and [r.rank for r in silent.cause.ranks] == [1, 2, 3]


def test_the_users_interrupt_wins_over_a_finished_run() -> None:
    interrupt = Interrupted(KeyboardInterrupt())
    outcome = classify(_evidence(outcomes={0: FINISHED, 1: FINISHED}, verdict=interrupt))
    assert outcome.end is AttemptEnd.INTERRUPTED and outcome.cause is interrupt


FAILURE = RankFailure(rank=0, host="h", exc_type="ValueError")
FAILED = NodeOutcome(GroupState.FAILED, {0: RankState.FAILED, 1: RankState.STOPPED}, failures=(FAILURE,))


def test_growing_is_decided_here_and_a_stall_is_the_drivers_verdict() -> None:
    request = GrowRequest(running=1, nodes=2, waited=3.0, step=4)
    grown = classify(_evidence(outcomes={0: _stopped(0, 0)}, grow=request))
    assert grown.cause == GrowRequested(request) and grown.end is AttemptEnd.GROW_REQUESTED
    stall = DriverStop(StopReason.STALLED, "no rank made progress")
    assert classify(_evidence(outcomes={0: _stopped(0, 0)}, verdict=stall)).cause is stall
    assert classify(_evidence(outcomes={0: _stopped(0, 0)}, verdict=stall, grow=request)).cause is stall
    # a rank that failed by itself is the cause, whatever the driver decided meanwhile
    failed = classify(_evidence(outcomes={0: FAILED}, verdict=stall)).cause
    assert isinstance(failed, RanksFailed) and failed.failures == (FAILURE,)


def test_a_job_that_failed_after_every_node_finished_failed() -> None:
    """Spark refused rank 0's result (over spark.driver.maxResultSize) after both nodes said over
    the channel that their ranks finished: the job's failure, not a success without a value."""
    error = RuntimeError("Job aborted: Total size of serialized results is bigger than spark.driver.maxResultSize")
    outcome = classify(_evidence(outcomes={0: FINISHED, 1: FINISHED}, spark_error=error, returned=set()))
    assert outcome.cause == SparkJobFailed(SparkFailureKind.RESULT_TOO_LARGE, "", error)


def test_the_outcome_keeps_the_nodes_outcomes_and_their_facts() -> None:
    kept = NodeOutcome(GroupState.SUCCEEDED, {0: RankState.FINISHED}, shard=ShardUse(1, 500, ShardSource.REUSED))
    outcome = classify(_evidence(outcomes={0: kept, 1: FINISHED}))
    assert outcome.nodes == {0: kept, 1: FINISHED} and outcome.shards == {0: ShardUse(1, 500, ShardSource.REUSED)}
    failed = classify(_evidence(outcomes={0: FAILED, 1: _stopped(1, 2)}, spark_error=RuntimeError("task failed")))
    assert failed.nodes == {0: FAILED, 1: _stopped(1, 2)} and failed.end is AttemptEnd.FAILED


def test_finished_nodes_whose_rows_never_came_did_not_complete() -> None:
    """Stopped by the timeout: both nodes said they finished, but the cancelled job returned no
    rows (no result): the timeout's outcome, naming no rank as still running."""
    outcome = classify(_evidence(outcomes={0: FINISHED, 1: FINISHED}, verdict=_time_up(), returned=set()))
    assert isinstance(outcome.cause, RanksStopped) and outcome.cause.ranks == ()
    one = classify(_evidence(outcomes={0: FINISHED, 1: FINISHED}, returned={0}))
    assert (
        isinstance(one.cause, StartProblem)
        and "only 1 of 2 Spark barrier tasks reported back" in one.cause.problem.message
    )


def test_a_failure_before_a_node_problem_before_missing_nodes() -> None:
    rows = Problem(ProblemKind.CONFIGURATION, "node 1 got 0 rows for its 2 ranks")
    problem = NodeOutcome(problem=rows)
    failed = classify(_evidence(outcomes={0: FAILED, 1: problem})).cause
    assert isinstance(failed, RanksFailed) and failed.failures == (FAILURE,)
    from_problem = classify(_evidence(outcomes={0: FINISHED, 1: problem}))
    assert from_problem.cause == StartProblem(rows) and from_problem.end is AttemptEnd.MISCONFIGURED
    # a node's problem ended the job: the same cause, with Spark's error kept
    spark_error = RuntimeError("task failed")
    ended = classify(_evidence(outcomes={1: problem}, spark_error=spark_error))
    assert ended.cause == StartProblem(rows, spark_error=spark_error)
    missing = classify(_evidence(outcomes={0: FINISHED}))
    assert isinstance(missing.cause, StartProblem) and missing.cause.problem.kind is ProblemKind.LAUNCH
    assert "only 1 of 2 Spark barrier tasks reported back" in missing.cause.problem.message
    empty = classify(_evidence(dataframe=True))
    assert isinstance(empty.cause, StartProblem) and empty.cause.problem.kind is ProblemKind.CONFIGURATION
    assert "the DataFrame is empty" in empty.cause.problem.message


def test_a_result_that_did_not_arrive_whole_is_a_launch_problem() -> None:
    def broken() -> bytes:
        raise LaunchError("rank 0's result: node 0 streamed 10 bytes over the channel, the driver has 3")

    outcome = classify(_evidence(outcomes={0: FINISHED, 1: FINISHED}, result=broken))
    assert isinstance(outcome.cause, StartProblem) and outcome.end is AttemptEnd.LAUNCH_FAILED
    assert "streamed 10 bytes" in outcome.cause.problem.message


def _table(*batches: Any) -> Any:
    import pyarrow as pa

    rows = [row for batch in batches for row in batch]
    return pa.Table.from_batches(rows, schema=rows[0].schema)


def test_the_task_rows_carry_each_nodes_outcome_sealed_with_the_runs_secret() -> None:
    stopped = _stopped(1, 2)
    table = _table(
        result_transfer.node_rows(0, FINISHED, SECRET, channel_error=None, delivered=None, result_file=None),
        result_transfer.node_rows(1, stopped, SECRET, channel_error="refused", delivered=None, result_file=None),
    )
    stage = result_transfer.read_stage(table, SECRET)
    assert stage.outcomes == {0: FINISHED, 1: stopped} and [n for n, o in stage.outcomes.items() if o.finished] == [0]
    assert stage.channel_errors == {1: "refused"}
    # rows sealed with another secret (or altered) say nothing: as if those nodes had not reported
    assert result_transfer.read_stage(table, b"x" * 32).outcomes == {}
    # node 1's sealed end in node 0's row says nothing either
    swapped = _table(
        result_transfer.node_rows(1, stopped, SECRET, channel_error=None, delivered=None, result_file=None)
    )
    assert result_transfer.read_stage(swapped.set_column(0, "node", _nodes(0)), SECRET).outcomes == {}


def _nodes(node: int) -> Any:
    import pyarrow as pa

    return pa.array([node], pa.int32())
