"""The states that travel between rank, node and driver: a stop keeps its first reason, a
problem parses back into the value that was sent (a node's end: tests/unit/test_node_outcome.py)."""

from __future__ import annotations

import pytest

from spark_torch.base.states import Problem, ProblemKind, StopReason, StopSignal


def test_a_stop_keeps_the_first_reason() -> None:
    stop = StopSignal()
    assert not stop.is_set() and stop.reason is None
    stop.request(StopReason.TIMEOUT)
    stop.request(StopReason.STALLED)
    assert stop.is_set() and stop.reason is StopReason.TIMEOUT


def test_a_stop_for_a_reason_unknown_here_still_stops() -> None:
    stop = StopSignal()
    stop.request(StopReason.parse("a reason from the future"))
    assert stop.is_set() and stop.reason is None


def test_a_problem_round_trips_bounded_and_refuses_anything_else() -> None:
    problem = Problem(ProblemKind.CONFIGURATION, "the DataFrame is empty")
    assert Problem.from_wire(problem.to_wire()) == problem
    assert Problem.from_wire(["LaunchError", "m" * 100_000]) == Problem(ProblemKind.LAUNCH, "m" * 8192)
    for malformed in (None, "LaunchError", ["Nope", "m"], ["LaunchError", 3], ["LaunchError"]):
        with pytest.raises(ValueError):
            Problem.from_wire(malformed)
