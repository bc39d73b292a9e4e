"""The states that travel between rank, node and driver: a stop keeps its first reason, a
node's end parses back into the value that was sent."""

from __future__ import annotations

import pytest

from spark_torch.base.states import (
    GroupState,
    NodeOutcome,
    ProblemKind,
    RankState,
    ShardSource,
    ShardUse,
    StopReason,
    StopSignal,
)


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


def test_a_node_outcome_round_trips() -> None:
    end = NodeOutcome(GroupState.STOPPED, {0: RankState.FINISHED, 3: RankState.STOPPED}, StopReason.TIMEOUT)
    assert NodeOutcome.from_wire(end.to_wire()) == end
    assert NodeOutcome.from_wire(NodeOutcome().to_wire()) == NodeOutcome()
    dumped = NodeOutcome(
        GroupState.STOPPED, {3: RankState.STOPPED}, StopReason.TIMEOUT, {3: ("/logs/nccl_trace_rank_3",)}
    )
    assert NodeOutcome.from_wire(dumped.to_wire()) == dumped
    assert (
        NodeOutcome.from_wire({"ranks": {}, "dumps": {"1": ["x" * 10_000] * 20}}).dumps[1] == ("x" * 4096,) * 8
    )  # bounded
    problem = NodeOutcome(problem=(ProblemKind.CONFIGURATION, "the DataFrame is empty"))
    assert NodeOutcome.from_wire(problem.to_wire()) == problem and not problem.finished
    assert NodeOutcome(GroupState.SUCCEEDED).finished
    kept = NodeOutcome(GroupState.SUCCEEDED, {0: RankState.FINISHED}, shard=ShardUse(1, 500, ShardSource.REUSED))
    assert NodeOutcome.from_wire(kept.to_wire()) == kept
    assert NodeOutcome.from_wire({"ranks": {}, "problem": ["LaunchError", "m" * 100_000]}).problem == (
        ProblemKind.LAUNCH,
        "m" * 8192,
    )


def test_an_outcome_without_state_dumps_or_problem_reads_as_none() -> None:
    assert NodeOutcome.from_wire({"ranks": {"0": "stopped"}, "stop": None}) == NodeOutcome(ranks={0: RankState.STOPPED})


@pytest.mark.parametrize(
    "body",
    [
        None,
        [],
        {"ranks": []},
        {"ranks": {"0": "exploded"}},
        {"ranks": {"x": "finished"}},
        {"ranks": {}, "dumps": {"0": "/a/path"}},
        {"ranks": {}, "dumps": {"0": [1]}},
        {"ranks": {}, "dumps": []},
        {"ranks": {}, "state": "exploded"},
        {"ranks": {}, "problem": "LaunchError"},
        {"ranks": {}, "problem": ["Nope", "m"]},
        {"ranks": {}, "problem": ["LaunchError", 3]},
        {"ranks": {}, "shard": [0, 1]},
        {"ranks": {}, "shard": [0, -1, "kept"]},
        {"ranks": {}, "shard": [0, 1, "borrowed"]},
        {"ranks": {}, "shard": [True, 1, "kept"]},
    ],
)
def test_a_malformed_node_outcome_is_refused(body: object) -> None:
    with pytest.raises(ValueError):
        NodeOutcome.from_wire(body)
