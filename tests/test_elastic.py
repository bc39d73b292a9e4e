"""Elastic membership: a run starts with the nodes there are (at least min_processes), goes on
with fewer after losing one, and grows back; every epoch exactly once, with real gloo
all-reduces. local[2], local-cluster[3,1,1024] (an executor JVM killed); the standalone test
(a worker stopped and started again) is in test_standalone.py."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from spark_torch import AttemptEnd, AttemptReason, AttemptSize, Distributor, InsufficientSlotsError, SizeReason

from .elastic_programs import count_epochs, rows_per_epoch


def test_starts_with_the_nodes_there_are(
    spark_session: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture, no_leftovers: None
) -> None:
    """local[2] has slots for 2 nodes: N=3, M=2 runs with 2 ranks and says so once."""
    import logging

    d = Distributor(num_processes=3, min_processes=2, local_mode=False, spark=spark_session, storage_path=tmp_path)
    with caplog.at_level(logging.WARNING, logger="spark_torch"):
        out = d.run(count_epochs, 3)
    assert out == {"count": 3.0, "world_size": 2}
    notes = [r.getMessage() for r in caplog.records if "starting with" in r.getMessage()]
    assert notes == [
        "spark_torch: starting with 2 of 3 ranks (min_processes=2): the cluster has slots for 2 of 3 nodes"
    ]
    assert d.last_run is not None and [a.world_size for a in d.last_run.attempts] == [2]
    first = d.last_run.attempts[0]
    assert first.reason is AttemptReason.START and first.end is AttemptEnd.SUCCEEDED
    assert first.size == AttemptSize(SizeReason.FEWER_SLOTS, nodes=2, max_nodes=3, procs_per_node=1), first
    assert first.size_note == "2 of 3 ranks: slots for 2 of 3 nodes", first
    assert set(d.last_run.metrics_dataframe["world_size"]) == {2}


def test_fewer_slots_than_the_minimum_fail_at_once(spark_session: Any) -> None:
    start = time.monotonic()
    d = Distributor(num_processes=4, min_processes=3, local_mode=False, spark=spark_session)
    with pytest.raises(InsufficientSlotsError) as info:
        d.run(count_epochs, 1)
    message = str(info.value)
    assert "needs at least 3 ranks (min_processes; num_processes=4)" in message and "has slots for 2 node(s)" in message
    assert "Lower min_processes" in message and time.monotonic() - start < 10
    # the check before the attempt ended it as an attempt: its record says so, nothing started
    assert d.last_run is not None and len(d.last_run.attempts) == 1
    attempt = d.last_run.attempts[0]
    assert attempt.end is AttemptEnd.MISCONFIGURED and attempt.size is None, attempt
    assert attempt.error is not None and attempt.error.type_name == "InsufficientSlotsError", attempt.error
    assert "needs at least 3 ranks" in attempt.error.first_line
    with pytest.raises(ValueError, match="min_processes=5 is more than num_processes=4"):
        Distributor(num_processes=4, min_processes=5, local_mode=False)
    with pytest.raises(ValueError, match="min_processes applies to distributed mode"):
        Distributor(num_processes=4, min_processes=2)


@pytest.mark.slow
def test_a_lost_executor_shrinks_the_run(cluster3_spark: Any, tmp_path: Path, no_leftovers: None) -> None:
    """local-cluster[3,1,1024], N=3, M=2: the last rank kills its executor JVM in epoch 2; the run
    goes on from the latest checkpoint with the nodes there are; every epoch exactly once."""
    d = Distributor(
        num_processes=3,
        min_processes=2,
        local_mode=False,
        spark=cluster3_spark,
        storage_path=tmp_path,
        max_restarts=2,
        elastic_wait=0,
    )
    out = d.run(count_epochs, 5, kill_executor_at=2)
    result = d.last_run
    assert result is not None and out["count"] == 5.0
    sizes = [a.world_size for a in result.attempts]
    assert sizes[0] == 3 and len(sizes) == 2 and sizes[1] in (2, 3), result.attempts
    assert result.attempts[0].end is AttemptEnd.FAILED and result.attempts[0].detail
    assert result.attempts[1].reason is AttemptReason.RESTART_AFTER_FAILURE
    assert result.attempts[1].end is AttemptEnd.SUCCEEDED
    if sizes[1] == 2:
        assert result.attempts[1].size_note == "2 of 3 ranks: slots for 2 of 3 nodes", result.attempts
    history = result.metrics_dataframe
    assert history["epoch"].tolist() == [1, 2, 3, 4, 5] and history["step"].tolist() == [1, 2, 3, 4, 5]
    assert history["world_size"].tolist()[2:] == [sizes[1]] * 3


@pytest.mark.slow
def test_an_executor_taken_away_shrinks_the_run_to_the_nodes_left(
    cluster3_spark: Any, tmp_path: Path, no_leftovers: None
) -> None:
    """local-cluster[3,1,1024], N=3, M=2: in epoch 2 the cluster manager takes one executor away
    for good (SparkContext.killExecutor lowers the application's target, as a scale-down or a
    preempted machine does, so no replacement comes); the run goes on with 2 nodes from the
    latest checkpoint, and says why. (A JVM that crashes is replaced by local-cluster's worker,
    sometimes before the restart: the test above.) The first attempt holds before epoch 4 until
    the executor's JVM has exited (count_epochs' ``lost_file``): it cannot end before it loses it."""
    import threading

    from .conftest import session_executors, wait_for_slots

    markers = tmp_path / "markers"
    markers.mkdir()
    gone = tmp_path / "executor-gone"
    jsc = cluster3_spark.sparkContext._jsc.sc()
    taken: list[str] = []
    done = threading.Event()
    wait_for_slots(cluster3_spark, 3)  # an earlier test's killed executor is replaced by now

    def take_one_away() -> None:
        while not (markers / "attempt-0-world-3-epoch-2").exists():
            if done.wait(0.05):
                return
        process = session_executors()[-1]
        executor = process.cmdline()
        taken.append(executor[executor.index("--executor-id") + 1])
        jsc.killExecutor(taken[0])
        process.wait(120)  # psutil.TimeoutExpired (the run then fails on its lost_file) if it stays
        gone.touch()

    taker = threading.Thread(target=take_one_away, daemon=True)
    taker.start()
    try:
        d = Distributor(
            num_processes=3,
            min_processes=2,
            local_mode=False,
            spark=cluster3_spark,
            storage_path=tmp_path / "runs",
            max_restarts=2,
            elastic_wait=0,
        )
        out = d.run(count_epochs, 5, str(markers), 0.05, lost_file=str(gone))
        result = d.last_run
        assert taken and result is not None and out == {"count": 5.0, "world_size": 2}
        assert [a.world_size for a in result.attempts] == [3, 2], result.attempts
        assert result.attempts[0].end is AttemptEnd.FAILED and result.attempts[0].detail
        assert result.attempts[1].reason is AttemptReason.RESTART_AFTER_FAILURE
        assert result.attempts[1].size_note == "2 of 3 ranks: slots for 2 of 3 nodes", result.attempts
        assert result.attempts[1].end is AttemptEnd.SUCCEEDED
        history = result.metrics_dataframe
        assert history["epoch"].tolist() == [1, 2, 3, 4, 5]
        assert history["world_size"].tolist()[:2] == [3, 3] and history["world_size"].tolist()[-1] == 2
    finally:
        done.set()
        taker.join(5)
        # the next tests get three executors again (requestExecutors(1) does not raise the target)
        jsc.requestTotalExecutors(3, 0, cluster3_spark.sparkContext._jvm.PythonUtils.toScalaMap({}))
        wait_for_slots(cluster3_spark, 3)


@pytest.mark.slow
def test_dataframe_rows_are_split_again_after_a_shrink(cluster3_spark: Any, tmp_path: Path, no_leftovers: None) -> None:
    """12 rows over 3 nodes, then over the nodes that are left: every row once per epoch."""
    df = cluster3_spark.range(12).selectExpr("id", "cast(id as double) as x")
    d = Distributor(
        num_processes=3,
        min_processes=2,
        local_mode=False,
        spark=cluster3_spark,
        storage_path=tmp_path,
        max_restarts=2,
        elastic_wait=0,
    )
    seen = d.run_on_dataframe(rows_per_epoch, df, 3, kill_executor_at=1)
    assert d.last_run is not None and len(d.last_run.attempts) == 2
    assert seen == [list(range(12))] * 3
