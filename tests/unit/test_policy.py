"""The restart policy, decided from the attempt's end alone."""

from __future__ import annotations

import pytest

from spark_torch.driver.result import AttemptEnd, AttemptReason
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
