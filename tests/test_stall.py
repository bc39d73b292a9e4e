"""Stall detection end to end: real Spark, real gloo, both modes, warm and cold rank starts.

Rank 1 blocks in a function of its own (``wait_for_the_loader``) while rank 0 waits in
all_reduce: the shape of the most common distributed hang.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import pytest

from spark_torch import AttemptEnd, AttemptReason, Distributor, RunStalledError, RunTimeoutError
from tests.conftest import SCRIPTS
from tests.stall_programs import one_rank_holds_the_gil, one_rank_stuck, silent_compute, stuck_once_after_a_checkpoint

TIMEOUT = 2.0


def _stall_records(caplog: Any) -> list[Any]:
    return [r for r in caplog.records if "no rank made progress" in r.getMessage()]


def _stall_warnings(caplog: Any) -> list[str]:
    return [r.getMessage() for r in _stall_records(caplog)]


def _moved_again(caplog: Any) -> list[str]:
    return [r.getMessage() for r in caplog.records if "moves again" in r.getMessage()]


def _distributor(mode: str, spark: Any, **kwargs: Any) -> Distributor:
    local, warm = mode.split("-")
    kwargs.setdefault("stall_timeout", TIMEOUT)
    return Distributor(
        num_processes=2, local_mode=local == "local", spark=None if local == "local" else spark,
        warm_start=warm == "warm", log_ranks=[], **kwargs,
    )  # fmt: skip


@pytest.mark.parametrize("mode", ["local-warm", "local-cold", "distributed-warm"])
def test_warn_shows_both_stacks_while_stuck_and_the_run_succeeds(
    mode: str, spark_session: Any, caplog: Any, tmp_path: Path, no_leftovers: None
) -> None:
    with caplog.at_level(logging.WARNING, logger="spark_torch"):
        assert _distributor(mode, spark_session, log_dir=tmp_path).run(one_rank_stuck, 4 * TIMEOUT) == 3
    warnings = _stall_warnings(caplog)
    assert warnings, "no stall warning"
    first = warnings[0]
    assert "rank 0: in all_reduce" in first and "rank 1: in wait_for_the_loader" in first, first
    assert "stall_timeout=2s" in first and "stall_action='fail'" in first
    assert 'in one_rank_stuck\n    dist.all_reduce(t)' in first  # file:line and the user's source line
    times = [r.created for r in _stall_records(caplog)]  # at most once per stall_timeout while it lasts
    assert all(later - earlier >= TIMEOUT * 0.9 for earlier, later in zip(times, times[1:])), times
    assert len(_moved_again(caplog)) == 1
    # torch's Flight Recorder (gloo records too): what each rank had in flight, and its JSON dump
    recorder = [r.getMessage() for r in caplog.records if "Flight Recorder, the collectives in flight" in r.getMessage()]
    assert recorder, "no Flight Recorder summary"
    assert "rank 0: gloo:all_reduce #" in recorder[0] and "rank 1: no collective in flight" in recorder[0], recorder
    traces = tmp_path / "flight-recorder" / "attempt-0"
    assert sorted(p.name for p in traces.iterdir()) == ["rank_0.json", "rank_1.json"]
    assert json.loads((traces / "rank_0.json").read_text())["entries"][0]["profiling_name"] == "gloo:all_reduce"


@pytest.mark.parametrize("mode", ["local-warm", "distributed-cold"])
def test_fail_stops_the_run_with_both_stacks(mode: str, spark_session: Any, no_leftovers: None) -> None:
    start = time.monotonic()
    with pytest.raises(RunStalledError) as info:
        _distributor(mode, spark_session, stall_action="fail").run(one_rank_stuck, 3600)
    took = time.monotonic() - start
    error = info.value
    message = str(error)
    assert "no rank made progress" in message and "stall_action='fail'" in message
    assert "rank 0: in all_reduce" in message and "rank 1: in wait_for_the_loader" in message, message
    assert set(error.stacks) == {0, 1} and "wait_for_the_loader" in error.stacks[1]
    assert "rank 0: gloo:all_reduce #" in message and "rank 1: no collective in flight" in message, message
    assert took < TIMEOUT + 30, took  # seconds after the stall, not the 30 min of a collective's timeout


@pytest.mark.parametrize("mode", ["local-warm", "distributed-warm"])
def test_ranks_that_compute_silently_are_not_stalled(mode: str, spark_session: Any, caplog: Any) -> None:
    # a longer timeout than the other tests: on a loaded 2-core machine the node's reports can
    # lag a second or two, and this test is about the ranks, not about how late a report comes
    timeout = 2 * TIMEOUT
    with caplog.at_level(logging.WARNING, logger="spark_torch"):
        assert _distributor(mode, spark_session, stall_timeout=timeout).run(silent_compute, 4 * timeout) == 2
    assert not _stall_warnings(caplog)


@pytest.mark.parametrize("mode", ["local-warm", "distributed-warm"])
def test_a_timeout_carries_every_ranks_stack(mode: str, spark_session: Any, no_leftovers: None) -> None:
    distributor = _distributor(mode, spark_session, timeout=8, stall_timeout=600)  # no stall: the timeout
    with pytest.raises(RunTimeoutError) as info:
        distributor.run(one_rank_stuck, 3600)
    error = info.value
    assert set(error.stacks) == {0, 1} and "wait_for_the_loader" in error.stacks[1], error.stacks
    assert "Where each rank was:" in str(error) and "rank 1: in wait_for_the_loader" in str(error)


def test_a_script_that_stalls(no_leftovers: None) -> None:
    distributor = Distributor(num_processes=2, stall_timeout=TIMEOUT, stall_action="fail", log_ranks=[])
    with pytest.raises(RunStalledError) as info:
        distributor.run(str(SCRIPTS / "stall_script.py"))
    assert "rank 1: in wait_for_the_loader" in str(info.value) and "stall_script.py" in info.value.stacks[1]


def test_a_stall_with_max_restarts_resumes_from_the_checkpoint(tmp_path: Path, caplog: Any, no_leftovers: None) -> None:
    distributor = Distributor(
        num_processes=2, stall_timeout=TIMEOUT, stall_action="fail", max_restarts=1, storage_path=tmp_path, log_ranks=[]
    )
    with caplog.at_level(logging.WARNING, logger="spark_torch"):
        out = distributor.run(stuck_once_after_a_checkpoint, 3)
    assert out == {"resumed_from": 1, "attempt": 1}
    attempts = distributor.last_run.attempts
    assert [a.end for a in attempts] == [AttemptEnd.STALLED, AttemptEnd.SUCCEEDED], attempts
    assert [a.reason for a in attempts] == [AttemptReason.START, AttemptReason.RESTART_AFTER_STALL]
    assert "no rank made progress" in (attempts[0].detail or "")
    assert distributor.last_run.metrics_dataframe["epoch"].tolist() == [1, 2, 3]


def test_a_rank_holding_the_gil_is_not_answering(caplog: Any, no_leftovers: None) -> None:
    with caplog.at_level(logging.WARNING, logger="spark_torch"):
        assert Distributor(num_processes=2, stall_timeout=3, log_ranks=[]).run(one_rank_holds_the_gil, 14) == 2
    warnings = _stall_warnings(caplog)
    assert warnings, "no stall warning"
    # its sampler cannot run: the last stack it took, marked
    assert any("rank 1: in one_rank_holds_the_gil (not answering for" in w for w in warnings), warnings
    assert all("rank 0: in all_reduce" in w for w in warnings)
