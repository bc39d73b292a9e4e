"""A stopped distributed run ends as the error of its cause, whichever way the stop races.

When the driver stops an attempt (its timeout, ``stall_action="fail"``), the nodes stop their
ranks and their barrier tasks return normally, their rows saying the ranks were stopped. If that happens before
the driver's cancel reaches Spark, the job *completes*; that completion once read as a finished
run and ended as ``LaunchError: only 0 of 2 Spark barrier tasks reported back`` without stacks.
These tests make that order certain: the cancel waits for the job to complete first. The timeout
test also makes its clock certain: the attempt's time is up the moment both ranks were sampled
(rank 1 in its own function), not after a fixed number of seconds that a loaded machine may need
just to start the barrier stage (test_run_distributed.py's ``test_timeout_distributed`` waits out a
real timeout).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from spark_torch import Distributor, RunStalledError, RunTimeoutError
from spark_torch.driver.run import barrier
from spark_torch.shared.stacks import StackState
from tests.stall_programs import one_rank_stuck

#: how long the job may take to end by itself once the nodes were stopped
JOB_END_SECONDS = 60.0
#: how long the ranks may take to start and be sampled (a loaded 2-core machine took over 45 s to
#: start a barrier stage)
SAMPLED_SECONDS = 240.0


@pytest.fixture
def job_completes_before_cancel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver's cancel waits until the stopped job has completed on its own (the losing
    order of the race, made certain), then cancels as usual."""
    cancel = barrier.cancel_tagged_job

    def late_cancel(spark: Any, tag: str) -> None:
        tracker = spark.sparkContext.statusTracker()
        deadline = time.monotonic() + JOB_END_SECONDS
        while any(
            (info := tracker.getJobInfo(job)) is not None and info.status == "RUNNING"
            for job in tracker.getJobIdsForGroup(tag)
        ):
            assert time.monotonic() < deadline, (
                f"the stopped job {tag} did not end within {JOB_END_SECONDS}s after its nodes were stopped; "
                "do the nodes return when the driver stops them?"
            )
            time.sleep(0.1)  # polling Spark's status tracker, which has no wait
        cancel(spark, tag)

    monkeypatch.setattr(barrier, "cancel_tagged_job", late_cancel)


def _both_sampled(stall: Any) -> bool:
    """Both ranks were sampled where the test expects them (rank 1 in its own function)."""
    stacks = {s.rank: s for s in stall.current()}
    return all(s.state is StackState.SAMPLED for s in stacks.values()) and "wait_for_the_loader" in stacks[1].text


class _TimeUpOnceSampled(threading.Event):
    """A barrier stage's wake event whose wait for the attempt's time ends, as a timeout does
    (False), as soon as both ranks were sampled; set by the job's end or a stall as usual."""

    def __init__(self, stage: Any) -> None:
        super().__init__()
        self.stage = stage

    def wait(self, timeout: float | None = None) -> bool:
        deadline = time.monotonic() + SAMPLED_SECONDS
        while not super().wait(0.1):  # polling the stall watch's stacks, which have no wait
            stall = self.stage.stall
            if stall is not None and _both_sampled(stall):
                return False  # the attempt's time is up
            assert time.monotonic() < deadline, (
                f"the ranks were not both sampled within {SAMPLED_SECONDS:g}s (rank 1 in wait_for_the_loader): "
                f"{None if stall is None else stall.current()}"
            )
        return True


@pytest.fixture
def time_up_once_both_ranks_are_sampled(monkeypatch: pytest.MonkeyPatch) -> None:
    """The attempt's timeout fires the moment both ranks were sampled, whatever ``timeout`` says."""
    init = barrier._BarrierStage.__init__

    def with_forced_clock(stage: Any, *args: Any, **kwargs: Any) -> None:
        init(stage, *args, **kwargs)
        stage.wake = _TimeUpOnceSampled(stage)

    monkeypatch.setattr(barrier._BarrierStage, "__init__", with_forced_clock)


def test_a_timeout_whose_job_completes_while_stopping(
    spark_session: Any,
    job_completes_before_cancel: None,
    time_up_once_both_ranks_are_sampled: None,
    no_leftovers: None,
) -> None:
    start = time.monotonic()
    # the timeout fires once both ranks were sampled (the fixture): the error must carry where they were
    with pytest.raises(RunTimeoutError, match=r"exceeded timeout=600s; the Spark job was cancelled") as info:
        Distributor(
            num_processes=2, local_mode=False, spark=spark_session, timeout=600, stall_timeout=600, log_ranks=[]
        ).run(one_rank_stuck, 3600)
    assert set(info.value.stacks) == {0, 1} and "wait_for_the_loader" in info.value.stacks[1], info.value.stacks
    assert time.monotonic() - start < SAMPLED_SECONDS + JOB_END_SECONDS  # not the 600 s timeout


def test_a_stall_whose_job_completes_while_stopping(
    spark_session: Any, job_completes_before_cancel: None, no_leftovers: None
) -> None:
    with pytest.raises(RunStalledError, match=r"stall_action='fail'") as info:
        Distributor(
            num_processes=2, local_mode=False, spark=spark_session, stall_timeout=2, stall_action="fail", log_ranks=[]
        ).run(one_rank_stuck, 3600)
    assert set(info.value.stacks) == {0, 1} and "wait_for_the_loader" in info.value.stacks[1], info.value.stacks
