"""Grouping rank stacks, and the driver's stall decision from synthetic node snapshots."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from spark_torch.driver.config import DistributorConfig
from spark_torch.driver.run.stall import StallWatch
from spark_torch.errors import ConfigurationError, RunStalledError
from spark_torch.stacks import RankStack, StackState, format_stacks, innermost_call, rank_ranges

REDUCE = '  File "train.py", line 12, in train\n    dist.all_reduce(t)\n'
LOAD = '  File "train.py", line 30, in load_batch\n    item = queue.get()\n'


def test_rank_ranges() -> None:
    assert rank_ranges([7, 0, 2, 3, 4]) == "0, 2-4, 7"
    assert rank_ranges([1]) == "1" and rank_ranges([]) == ""


def test_ranks_with_the_same_stack_are_grouped_largest_first() -> None:
    stacks = [RankStack(r, REDUCE, 5.0) for r in (0, 2, 3, 4, 5, 6, 7)] + [RankStack(1, LOAD, 5.0)]
    text = format_stacks(stacks)
    assert text.splitlines()[0] == "ranks 0, 2-7: in train"
    assert "rank 1: in load_batch\n" + LOAD.rstrip() in text
    assert innermost_call(LOAD) == "load_batch"


def test_a_rank_not_answering_and_a_starting_rank_are_labelled() -> None:
    text = format_stacks([RankStack(0, REDUCE, 9.0, StackState.NOT_ANSWERING, age=12.0), RankStack(1, "", 0.0, StackState.STARTING)])
    assert "rank 0: in train (not answering for 12s" in text and "rank 1 (starting: not sampled yet)" in text


def _snapshot(idle: float) -> list[dict[str, Any]]:
    return [RankStack(0, REDUCE, idle).to_dict(), RankStack(1, LOAD, idle).to_dict()]


def test_warn_says_it_once_per_stall_timeout_and_when_the_run_moves_again(caplog: Any) -> None:
    watch = StallWatch(2, timeout=10.0, action="warn")
    watch.close()  # no thread: the test calls check() itself
    with caplog.at_level(logging.WARNING, logger="spark_torch"):
        watch.update(0, _snapshot(3.0))
        watch.check()
        assert not caplog.records
        watch.update(0, _snapshot(11.0))
        watch.check()
        watch.check()  # still stalled: not said again within stall_timeout
        watch.update(0, _snapshot(0.5))
        watch.check()
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2 and "no rank made progress for 11s" in messages[0], messages
    assert "moves again" in messages[1]


def test_fail_stops_once_and_makes_the_error() -> None:
    stopped: list[str] = []
    watch = StallWatch(2, timeout=10.0, action="fail", stop=stopped.append)
    watch.close()
    watch.update(0, _snapshot(12.0))
    watch.check()
    watch.check()
    assert len(stopped) == 1 and watch.failed.is_set()
    error = watch.error()
    assert isinstance(error, RunStalledError) and set(error.stacks) == {0, 1}
    assert "rank 1: in load_batch" in str(error)


def test_malformed_snapshots_are_ignored() -> None:
    watch = StallWatch(2, timeout=10.0)
    watch.close()
    watch.update(0, "not a list")
    watch.update(0, [{"rank": "x"}, {"no": "rank"}, {"rank": 99, "text": "", "idle": 1}])
    assert all(s.state is StackState.STARTING for s in watch.current())


def test_stall_settings_are_checked() -> None:
    assert DistributorConfig(stall_timeout=0).stall_timeout == 0.0
    assert DistributorConfig(stall_action="FAIL").stall_action == "fail"
    with pytest.raises(ConfigurationError, match="use 'warn' .* or 'fail'"):
        DistributorConfig(stall_action="explode")
    with pytest.raises(ConfigurationError, match="stall_timeout='-1' must be a number of seconds >= 0"):
        DistributorConfig(stall_timeout=-1)
