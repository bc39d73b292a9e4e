"""An attempt's end as typed data: each cause's end, and the one place it becomes an exception."""

from __future__ import annotations

import pickle
import threading
import time

import pytest

from spark_torch.base.background import BackgroundCall
from spark_torch.base.states import GroupState, Problem, ProblemKind, RankState, StopReason
from spark_torch.driver.result import AttemptEnd, GrowRequest
from spark_torch.driver.run.failures import SparkJobError, attempt_error, classify_spark_text
from spark_torch.driver.run.outcome import (
    AttemptOutcome,
    DriverStop,
    GrowRequested,
    Interrupted,
    RanksFailed,
    RanksStopped,
    SparkFailureKind,
    SparkJobFailed,
    Stacks,
    StartProblem,
    still_running,
    timed_out,
)
from spark_torch.errors import (
    ConfigurationError,
    DistributedRunError,
    InsufficientSlotsError,
    LaunchError,
    RankFailure,
    RunStalledError,
    RunTimeoutError,
    StoppedRank,
)
from spark_torch.node.group_result import GroupResult, RankStatus
from spark_torch.shared.node_outcome import NodeOutcome


def _failure(rank: int = 1) -> RankFailure:
    return RankFailure(rank=rank, host="h", exc_type="ValueError", exc_message="bad batch", failed_at=1.0)


def test_a_node_problem_is_the_users_error_with_its_message_and_no_invented_cause() -> None:
    kinds = (
        (ProblemKind.LAUNCH, LaunchError),
        (ProblemKind.CONFIGURATION, ConfigurationError),
        (ProblemKind.SLOTS, InsufficientSlotsError),
    )
    for kind, error_type in kinds:
        error = attempt_error(AttemptOutcome.ended(StartProblem(Problem(kind, "the script is missing; ship it"))))
        assert type(error) is error_type and str(error) == "the script is missing; ship it" and error.__cause__ is None


def test_each_cause_has_its_end_and_its_error() -> None:
    cases: list[tuple[object, AttemptEnd, type[BaseException]]] = [
        (RanksFailed((_failure(),)), AttemptEnd.FAILED, DistributedRunError),
        (StartProblem(Problem(ProblemKind.LAUNCH, "no script")), AttemptEnd.LAUNCH_FAILED, LaunchError),
        (
            StartProblem(Problem(ProblemKind.CONFIGURATION, "bad shards")),
            AttemptEnd.MISCONFIGURED,
            ConfigurationError,
        ),
        (
            SparkJobFailed(SparkFailureKind.MISSING_MODULE, "torch", RuntimeError("x")),
            AttemptEnd.LAUNCH_FAILED,
            LaunchError,
        ),
        (
            SparkJobFailed(SparkFailureKind.TOO_FEW_SLOTS, "", RuntimeError("x")),
            AttemptEnd.MISCONFIGURED,
            InsufficientSlotsError,
        ),
        (
            SparkJobFailed(SparkFailureKind.EXECUTOR_LOST, "lost", RuntimeError("x")),
            AttemptEnd.FAILED,
            DistributedRunError,
        ),
        (
            SparkJobFailed(SparkFailureKind.RESULT_TOO_LARGE, "", RuntimeError("x")),
            AttemptEnd.FAILED,
            DistributedRunError,
        ),
        (SparkJobFailed(SparkFailureKind.OTHER, "boom", RuntimeError("x")), AttemptEnd.LAUNCH_FAILED, LaunchError),
        (
            StartProblem.of(ProblemKind.CONFIGURATION, "the DataFrame is empty"),
            AttemptEnd.MISCONFIGURED,
            ConfigurationError,
        ),
        (StartProblem.of(ProblemKind.LAUNCH, "only 1 of 2 tasks"), AttemptEnd.LAUNCH_FAILED, LaunchError),
        # the checks before an attempt: too few slots, executors whose Python cannot run a node
        (StartProblem.of(ProblemKind.SLOTS, "needs 4 slots, has 2"), AttemptEnd.MISCONFIGURED, InsufficientSlotsError),
        (StartProblem.of(ProblemKind.LAUNCH, "the executors' Python"), AttemptEnd.LAUNCH_FAILED, LaunchError),
        (
            RanksStopped(2.0, (StoppedRank(0, "h", ("last",)),), "rank 0 was still running and stopped"),
            AttemptEnd.TIMED_OUT,
            RunTimeoutError,
        ),
        (DriverStop(StopReason.STALLED, "the run stalled"), AttemptEnd.STALLED, RunStalledError),
        (DriverStop(StopReason.REPORT_DEADLOCK, "report() on rank 0 only"), AttemptEnd.FAILED, DistributedRunError),
        (Interrupted(KeyboardInterrupt()), AttemptEnd.INTERRUPTED, KeyboardInterrupt),
    ]
    for cause, end, kind in cases:
        outcome = AttemptOutcome.ended(cause)  # type: ignore[arg-type]
        assert outcome.end is end, cause
        error = attempt_error(outcome)
        assert type(error) is kind or (kind is DistributedRunError and type(error) is DistributedRunError), (
            cause,
            error,
        )
    assert (
        AttemptOutcome.ended(GrowRequested(GrowRequest(running=2, nodes=3, waited=5.0, step=4))).end
        is AttemptEnd.GROW_REQUESTED
    )
    with pytest.raises(AssertionError):
        attempt_error(AttemptOutcome.ended(GrowRequested(GrowRequest(running=2, nodes=3, waited=5.0, step=4))))
    with pytest.raises(AssertionError):
        attempt_error(AttemptOutcome.succeeded(None))


def test_a_timeout_names_stopped_ranks_not_failures_and_pickles() -> None:
    cause = RanksStopped(
        5.0,
        (StoppedRank(1, "h", ("step 7",)), StoppedRank(0, "h", ())),
        "ranks 0, 1 were still running and stopped",
        Stacks({0: "in all_reduce"}, "rank 0: in all_reduce"),
    )
    error = attempt_error(AttemptOutcome.ended(cause))
    assert isinstance(error, RunTimeoutError) and isinstance(error, TimeoutError)
    assert error.failures == () and [s.rank for s in error.stopped] == [0, 1]
    text = str(error)
    assert text.startswith("the run exceeded timeout=5s; ranks 0, 1 were still running and stopped")
    assert "Last 1 lines of rank 1's output on h:" in text and "Stopped while still running: ranks 0, 1" in text
    assert "still running: stopped" not in text and "rank 0: in all_reduce" in text
    again = pickle.loads(pickle.dumps(error))
    assert str(again) == text and again.stopped == error.stopped


def test_spark_text_is_classified_and_chained_without_java() -> None:
    assert classify_spark_text("ModuleNotFoundError: No module named 'torch'") == (
        SparkFailureKind.MISSING_MODULE,
        "torch",
    )
    assert (
        classify_spark_text("x requires more slots than the total number of slots y")[0]
        is SparkFailureKind.TOO_FEW_SLOTS
    )
    kind, detail = classify_spark_text("Job aborted\nExecutorLostFailure (executor 1 exited)")
    assert kind is SparkFailureKind.EXECUTOR_LOST and detail.startswith("ExecutorLostFailure")
    error = attempt_error(
        AttemptOutcome.ended(SparkJobFailed(SparkFailureKind.OTHER, "boom", RuntimeError("boom\n\tat a.b(C.java:1)")))
    )
    assert isinstance(error.__cause__, SparkJobError) and "\tat " not in str(error.__cause__)


def test_a_node_problem_travels_as_its_kind_and_message_and_an_unknown_kind_is_malformed() -> None:
    outcome = NodeOutcome(problem=Problem(ProblemKind.CONFIGURATION, "bad shards"))
    data = outcome.to_wire()
    assert data["problem"] == ["ConfigurationError", "bad shards"] and data["failures"] == []
    assert NodeOutcome.from_wire(data) == outcome and outcome.problem is not None
    for malformed in (["SomethingElse", "bad shards"], ["ConfigurationError"], "ConfigurationError: bad shards"):
        with pytest.raises(ValueError):
            NodeOutcome.from_wire({**data, "problem": malformed})
    assert StopReason.parse("timeout") is StopReason.TIMEOUT and StopReason.parse("nonsense") is None
    assert RankState("failed") is RankState.FAILED and str(RankState.STOPPED) == "stopped"


def test_a_group_result_is_a_state_and_each_ranks_status() -> None:
    failed = GroupResult(
        GroupState.FAILED,
        (RankStatus(0, RankState.STOPPED), RankStatus(1, RankState.FAILED, failure=_failure())),
        pickled={1: "blob"},
    )
    assert failed.failures == (_failure(),) and failed.still_running() == ()
    stopped = GroupResult(
        GroupState.STOPPED, (RankStatus(0, RankState.FINISHED), RankStatus(1, RankState.STOPPED, ("x",)))
    )
    assert [s.rank for s in stopped.still_running()] == [1] and stopped.failures == ()


def test_background_call_keeps_the_value_the_error_and_waits_with_a_deadline() -> None:
    woke = threading.Event()
    ok = BackgroundCall(lambda: 42, name="t-ok", on_done=woke.set).start()
    assert ok.wait(5.0) and ok.value == 42 and ok.error is None and woke.is_set()

    def fails() -> None:
        raise KeyError("x")

    bad = BackgroundCall(fails, name="t-bad").start()
    assert bad.wait(5.0) and isinstance(bad.error, KeyError) and bad.value is None
    release = threading.Event()
    slow = BackgroundCall(lambda: release.wait(10.0), name="t-slow").start()
    start = time.monotonic()
    assert not slow.wait(0.2) and not slow.done and slow.value is None and slow.error is None
    assert time.monotonic() - start < 5.0
    release.set()
    assert slow.wait(5.0) and slow.value is True


def test_a_timeout_says_which_ranks_it_found_running() -> None:
    assert still_running((StoppedRank(0, "h"),)) == "rank 0 was still running and stopped"
    assert still_running((StoppedRank(0, None), StoppedRank(3, None))) == "ranks 0, 3 were still running and stopped"
    assert still_running(()).startswith("no rank was running")


def test_a_timeout_names_the_ranks_each_nodes_end_says_were_running_in_either_mode() -> None:
    """One function for both modes: node 1 said rank 2 was stopped and rank 3 had finished; node 0
    never said (it could not reach the driver): its ranks count as running. Dumps and lines travel."""
    ends = {
        1: NodeOutcome(
            GroupState.STOPPED,
            {2: RankState.STOPPED, 3: RankState.FINISHED},
            StopReason.TIMEOUT,
            {2: ("/tmp/nccl_trace_rank_2",)},
        )
    }
    node_ranks = {0: range(0, 2), 1: range(2, 4)}
    cause = timed_out(
        5.0, ends, node_ranks, lambda rank: (f"line of {rank}",), Stacks(), note="the Spark job was cancelled; "
    )
    assert [s.rank for s in cause.ranks] == [0, 1, 2] and cause.ranks[2].dumps == ("/tmp/nccl_trace_rank_2",)
    assert cause.ranks[0].last_lines == ("line of 0",) and cause.ranks[0].host is None
    assert cause.what == "the Spark job was cancelled; ranks 0, 1, 2 were still running and stopped"
    error = attempt_error(AttemptOutcome.ended(cause))
    assert type(error) is RunTimeoutError and "timeout=5s; the Spark job was cancelled; ranks 0, 1, 2 were" in str(
        error
    )
    # local mode: its one node said; only rank 1 ran on
    local = timed_out(
        2.0,
        {0: NodeOutcome(GroupState.STOPPED, {0: RankState.FINISHED, 1: RankState.STOPPED})},
        {0: range(2)},
        lambda rank: (),
        Stacks(),
        host="h",
    )
    assert [(s.rank, s.host) for s in local.ranks] == [
        (1, "h")
    ] and local.what == "rank 1 was still running and stopped"
