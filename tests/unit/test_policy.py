"""The restart policy, decided from the attempt's end alone (its row of ``END_RULES``), and the
tables that declare what each end and each stop reason mean."""

from __future__ import annotations

import pytest

from spark_torch.base.states import StopReason
from spark_torch.driver.attempts import END_RULES, STOP_ENDS, Follow
from spark_torch.driver.result import AttemptEnd, AttemptReason, GrowRequest
from spark_torch.driver.run.outcome import DriverStop, GrowRequested, Interrupted, RanksStopped
from spark_torch.driver.run.policy import Action, RestartPolicy


def test_success_finishes() -> None:
    assert RestartPolicy(3).decide(AttemptEnd.SUCCEEDED, 0).action is Action.FINISH


@pytest.mark.parametrize(
    "end, reason",
    [(AttemptEnd.FAILED, AttemptReason.RESTART_AFTER_FAILURE), (AttemptEnd.STALLED, AttemptReason.RESTART_AFTER_STALL)],
)
def test_failures_and_stalls_restart_while_restarts_are_left(end: AttemptEnd, reason: AttemptReason) -> None:
    policy = RestartPolicy(2)
    assert policy.decide(end, 0).reason is reason and policy.decide(end, 0).counts
    assert policy.decide(end, 1).action is Action.RESTART
    assert policy.decide(end, 2).action is Action.RAISE
    assert RestartPolicy(0).decide(end, 0).action is Action.RAISE
    assert RestartPolicy(-1).decide(end, 10_000).action is Action.RESTART


def test_growing_restarts_without_using_a_restart() -> None:
    decision = RestartPolicy(0).decide(AttemptEnd.GROW_REQUESTED, 0)
    assert decision.action is Action.RESTART and decision.reason is AttemptReason.GROW and not decision.counts


@pytest.mark.parametrize(
    "end", [AttemptEnd.TIMED_OUT, AttemptEnd.INTERRUPTED, AttemptEnd.LAUNCH_FAILED, AttemptEnd.MISCONFIGURED]
)
def test_timeouts_interruptions_launch_failures_and_misconfigurations_always_raise(end: AttemptEnd) -> None:
    assert RestartPolicy(-1).decide(end, 0).action is Action.RAISE


def test_every_end_and_every_stop_reason_is_declared_once() -> None:
    """The two tables say what every end means and what every stop reason ends as; an end is an
    error exactly when the run may raise it."""
    assert set(END_RULES) == set(AttemptEnd)
    assert set(STOP_ENDS) == set(StopReason)
    errors = {end for end, rule in END_RULES.items() if rule.error}
    assert errors == set(AttemptEnd) - {AttemptEnd.SUCCEEDED, AttemptEnd.GROW_REQUESTED}
    for end, rule in END_RULES.items():  # a restart says why the next attempt starts
        assert (rule.restart is not None) == (rule.follows in (Follow.RESTART, Follow.RESTART_COUNTED)), end


def test_a_stop_ends_as_its_reason_says() -> None:
    stops: list[RanksStopped | DriverStop | Interrupted | GrowRequested] = [
        RanksStopped(1.0, (), "no rank was running"),
        DriverStop(StopReason.STALLED, "stalled"),
        DriverStop(StopReason.REPORT_DEADLOCK, "report() on rank 0 only"),
        Interrupted(KeyboardInterrupt()),
        GrowRequested(GrowRequest(1, 2, 3.0, 4)),
    ]
    ends = [stop.end for stop in stops]
    assert ends == [STOP_ENDS[stop.reason] for stop in stops]
    assert ends == [
        AttemptEnd.TIMED_OUT,
        AttemptEnd.STALLED,
        AttemptEnd.FAILED,
        AttemptEnd.INTERRUPTED,
        AttemptEnd.GROW_REQUESTED,
    ]
