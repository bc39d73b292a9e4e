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


@pytest.mark.parametrize("body", [None, [], {"ranks": []}, {"ranks": {"0": "exploded"}}, {"ranks": {"x": "finished"}}])
def test_a_malformed_node_end_is_refused(body: object) -> None:
    with pytest.raises(ValueError):
        NodeEnd.from_wire(body)
