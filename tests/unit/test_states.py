"""The states that travel between rank, node and driver: a stop keeps its first reason, a
node's end parses back into the value that was sent."""

from __future__ import annotations

import pytest

from spark_torch.base.states import NodeEnd, RankState, StopReason, StopSignal


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


def test_a_node_end_round_trips() -> None:
    end = NodeEnd({0: RankState.FINISHED, 3: RankState.STOPPED}, StopReason.TIMEOUT)
    assert NodeEnd.from_wire(end.to_wire()) == end
    assert NodeEnd.from_wire(NodeEnd().to_wire()) == NodeEnd()
    dumped = NodeEnd({3: RankState.STOPPED}, StopReason.TIMEOUT, {3: ("/logs/nccl_trace_rank_3",)})
    assert NodeEnd.from_wire(dumped.to_wire()) == dumped
    assert NodeEnd.from_wire({"ranks": {}, "dumps": {"1": ["x" * 10_000] * 20}}).dumps[1] == ("x" * 4096,) * 8  # bounded


def test_an_end_from_an_older_node_has_no_dumps() -> None:
    assert NodeEnd.from_wire({"ranks": {"0": "stopped"}, "stop": None}).dumps == {}


@pytest.mark.parametrize("body", [None, [], {"ranks": []}, {"ranks": {"0": "exploded"}}, {"ranks": {"x": "finished"}},
     {"ranks": {}, "dumps": {"0": "/a/path"}}, {"ranks": {}, "dumps": {"0": [1]}}, {"ranks": {}, "dumps": []}])
def test_a_malformed_node_end_is_refused(body: object) -> None:
    with pytest.raises(ValueError):
        NodeEnd.from_wire(body)
