"""Grouping rank stacks and their headers, the driver's stall decision and what it says from
synthetic node snapshots, a faulthandler dump read back, and a rank's progress signals."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import pytest

from spark_torch.driver.config import DistributorConfig
from spark_torch.driver.run.failures import attempt_error
from spark_torch.driver.run.outcome import AttemptOutcome
from spark_torch.driver.run.stall import StallWatch, note_stacks
from spark_torch.errors import ConfigurationError, RunStalledError
from spark_torch.shared.stacks import (
    RankStack,
    StackState,
    cut_head,
    cut_tail,
    format_stacks,
    innermost_call,
    rank_ranges,
    strip_source_lines,
)

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
    text = format_stacks(
        [RankStack(0, REDUCE, 9.0, StackState.NOT_ANSWERING, age=12.0), RankStack(1, "", 0.0, StackState.STARTING)]
    )
    assert "rank 0: in train (not answering for 12s" in text and "rank 1 (starting: not sampled yet)" in text
    assert "its last sampled stack, or faulthandler's when the run is being stopped" in text


def test_a_rank_never_sampled_since_its_sampler_started_has_not_answered() -> None:
    text = format_stacks([RankStack(1, "", 9.0, StackState.NOT_ANSWERING, age=30.0)])
    assert text.startswith("rank 1 (has not answered since it started 30s ago: a native call may hold the GIL)"), text


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
    error = attempt_error(AttemptOutcome.ended(watch.verdict()))
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


TORCH = "/venv/lib/python3.11/site-packages/torch/"
IN_REDUCE = (
    '  File "/job/train.py", line 12, in train\n    dist.all_reduce(t)\n'
    f'  File "{TORCH}distributed/distributed_c10d.py", line 3252, in all_reduce\n    work.wait()\n'
)
IN_REPORT = '  File "/job/train.py", line 40, in train\n    spark_torch.report(m)\n  File "/x/spark_torch/reporting/api.py", line 221, in report\n'
IN_LOADER = (
    '  File "/job/train.py", line 7, in train\n    for batch in loader:\n'
    f'  File "{TORCH}utils/data/dataloader.py", line 1283, in _try_get_data\n    data = self._data_queue.get(timeout=timeout)\n'
    '  File "/usr/lib/python3.11/multiprocessing/queues.py", line 113, in get\n    if not self._poll(timeout):\n'
    '  File "/usr/lib/python3.11/selectors.py", line 415, in select\n    fd_event_list = self._selector.poll(timeout)\n'
    "  Process 7 (forked by this rank: a DataLoader worker?):\n"
    '  File "/job/train.py", line 3, in __getitem__\n    lock.acquire()\n'
)


def test_the_header_names_the_innermost_frame_that_is_not_pythons_own() -> None:
    assert innermost_call(IN_REDUCE) == "all_reduce, from train"  # a library's call, and the user's line under it
    assert innermost_call(IN_REPORT) == "spark_torch.report()"  # never an internal function of ours
    assert innermost_call(IN_LOADER) == "_try_get_data, from train"  # not select, not the worker's frame
    assert innermost_call('  File "/usr/lib/python3.11/threading.py", line 1, in wait\n') == "wait"


def test_source_lines_can_be_left_out() -> None:
    assert strip_source_lines(IN_REDUCE) == (
        '  File "/job/train.py", line 12, in train\n'
        f'  File "{TORCH}distributed/distributed_c10d.py", line 3252, in all_reduce\n'
    )


def test_each_ranks_last_output_goes_with_its_stack() -> None:
    text = format_stacks([RankStack(0, REDUCE, 5.0, output="epoch 3\nloss 0.1\n"), RankStack(1, LOAD, 5.0)])
    assert "rank 0: in train\n" + REDUCE + "  rank 0's last output:\n    epoch 3\n    loss 0.1" in text


def test_a_stopped_rank_is_named_stopped() -> None:
    text = format_stacks([RankStack(1, LOAD, 9.0, StackState.STOPPED, age=12.0)])
    assert text.startswith("rank 1: in load_batch (its process is stopped: SIGSTOP or a debugger") and "GIL" not in text


def test_warn_shows_the_stacks_once_then_one_line_unless_a_stack_changed(caplog: Any) -> None:
    watch = StallWatch(2, timeout=10.0, action="warn")
    watch.close()
    with caplog.at_level(logging.WARNING, logger="spark_torch"):
        watch.update(0, _snapshot(11.0))
        watch.check()
        for idle in (21.0, 31.0):
            watch._warned_at -= 10.0  # a stall_timeout later
            watch.update(0, _snapshot(idle))
            watch.check()
        watch._warned_at -= 10.0
        watch.update(0, [RankStack(0, REDUCE, 41.0).to_dict(), RankStack(1, REDUCE, 41.0).to_dict()])
        watch.check()
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 4, messages
    assert "rank 1: in load_batch" in messages[0]
    assert messages[1:3] == [
        "spark_torch: still stalled after 21s; ranks unchanged",
        "spark_torch: still stalled after 31s; ranks unchanged",
    ]
    assert "ranks 0-1: in train" in messages[3]  # rank 1's stack changed: shown again


def test_a_stopped_attempt_says_no_moves_again_line(caplog: Any) -> None:
    watch = StallWatch(2, timeout=10.0, action="warn")
    with caplog.at_level(logging.WARNING, logger="spark_torch"):
        watch.update(0, _snapshot(11.0))
        watch.check()
        interrupt = KeyboardInterrupt()
        note_stacks(interrupt, watch)  # Ctrl-C: the stacks go with the exception, not the log
        watch.close()
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and "no rank made progress" in messages[0], messages
    assert "rank 1: in load_batch" in interrupt.__notes__[0] and set(interrupt.stacks) == {0, 1}  # type: ignore[attr-defined]


def test_ranks_no_node_reported_are_setting_up_not_stalled(caplog: Any) -> None:
    watch = StallWatch(2, timeout=0.001, action="fail", stop=lambda reason: None)
    watch.close()
    watch.update(0, [RankStack(0, REDUCE, 100.0).to_dict()])  # rank 1's node is still downloading a checkpoint
    watch.check()
    assert not watch.failed.is_set()
    assert [s.state for s in watch.current()] == [StackState.SAMPLED, StackState.STARTING]


def test_a_faulthandler_dump_becomes_the_main_threads_stack() -> None:
    from spark_torch.node.rank_view import parse_dump

    dump = (
        "Thread 0x00007f0000000002 (most recent call first):\n"
        '  File "/usr/lib/python3.11/threading.py", line 320 in wait\n\n'
        "Current thread 0x00007f0000000001 (most recent call first):\n"
        '  File "/job/train.py", line 9 in hold\n'
        '  File "/job/train.py", line 20 in train\n'
        '  File "/x/spark_torch/rank/function_main.py", line 70 in main\n'
    )
    assert parse_dump(dump, 0x7F0000000001) == (
        '  File "/job/train.py", line 20, in train\n  File "/job/train.py", line 9, in hold\n'
    )
    assert parse_dump(dump, 5) == ""  # not its main thread


def test_a_faulthandler_stack_gets_its_source_lines(tmp_path: Any) -> None:
    from spark_torch.node.rank_view import with_source_lines

    source = tmp_path / "train.py"
    source.write_text("import x\n\n    hold_the_gil()  \n")
    text = f'  File "{source}", line 3, in train\n  File "/nowhere.py", line 1, in gone\n'
    assert (
        with_source_lines(text)
        == f'  File "{source}", line 3, in train\n    hold_the_gil()\n  File "/nowhere.py", line 1, in gone\n'
    )


def _compute(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


HERE = [("/job/train.py", 1, "train")]
IN_C10D = [("/t/torch/distributed/distributed_c10d.py", 3252, "all_reduce")]


class _Readings:
    """A thread's signals as a sampler would read them, made by hand (the rule alone: no clock,
    no ``/proc``, so what a loaded machine does to a real thread cannot change the verdict)."""

    def __init__(self, interval: float) -> None:
        from spark_torch.rank.progress_signals import Progress, Reading

        self.now = Reading(
            at=100.0, cpu=1.0, io=(10, 10, 5, 0), reports=0, working=False, collectives=None, others=3.0, others_bytes=0
        )
        progress = Progress.__new__(Progress)  # its rule, fed the readings below instead of /proc
        progress._clock = 1
        progress._busy = interval
        progress._last, progress._since, progress._cpu_since, progress._seen = self.now, self.now.at, 0.0, set()
        self.progress = progress

    def step(
        self, seconds: float, frames: list[tuple[str, int, str]] = HERE, waits: bool = False, **change: Any
    ) -> bool:
        """``seconds`` later, with ``change`` added to the last reading's counters (``cpu``,
        ``others``, ``reports``, ``others_bytes``; ``io``: a tuple added field by field)."""
        import dataclasses

        fields: dict[str, Any] = {"at": self.now.at + seconds}
        for name, delta in change.items():
            was = getattr(self.now, name)
            fields[name] = tuple(x + d for x, d in zip(was, delta)) if name == "io" else was + delta
        self.now = dataclasses.replace(self.now, **fields)
        return self.progress.judge(self.now, tuple(HERE), 10, frames, waits)


def test_progress_is_computing_or_io_not_waiting() -> None:
    """The rule on a thread's readings: waiting (microseconds of CPU a wake-up) is none; its CPU
    time, its I/O, its page faults are; CPU time in a collective is none; another thread's CPU
    time is when the thread waits on one."""
    watch = _Readings(interval=0.2)
    assert not watch.step(0.2)  # the first position is no progress
    assert not any(watch.step(0.2, cpu=0.00005) for _ in range(50))  # waiting: a wake-up's CPU time, no I/O
    assert watch.step(0.2, cpu=0.1)  # its CPU time
    assert watch.step(0.2, io=(0, 1, 0, 0))  # its I/O
    assert watch.step(0.2, io=(0, 0, 3, 0))  # pages memory in (a library being loaded)
    assert not watch.step(0.2, IN_C10D, cpu=0.2)  # CPU time in a collective (a spinning synchronize) is none
    assert not watch.step(1.1, others=0.1)  # another thread computes: not its work unless it waits on it
    assert watch.step(1.1, waits=True, others=0.1)  # ... as a join does: 0.1 s of CPU in over 1 s still counts
    assert not watch.step(1.1, waits=True, others_bytes=1024)  # a store's polling: a few bytes
    assert watch.step(1.1, waits=True, others_bytes=64 * 1024)  # an upload on another thread
    assert watch.step(0.2, reports=1)  # report()


def test_computing_is_judged_over_the_time_since_the_last_progress() -> None:
    """A thread starved of CPU (a loaded machine: under a tenth of a core in every sample) computes
    however small its share, down to WINDOW_SHARE of the time since its last progress, or once its
    CPU time adds up to a sample interval; a waiting thread's wake-ups never add up to either."""
    from spark_torch.rank.progress_signals import MIN_CPU, SAMPLE_SHARE, WINDOW_SHARE, computing

    assert computing(0.01, 0.2, 0.2)  # 5% of a core: more than 100 busy threads on 2 cores
    assert computing(WINDOW_SHARE * 2.0, 2.0, 0.2) and not computing(WINDOW_SHARE * 2.0 * 0.9, 2.0, 0.2)
    assert computing(1.0, 3600.0, 1.0)  # a whole interval, however long it took
    assert not computing(MIN_CPU, MIN_CPU / WINDOW_SHARE, 0.2)  # one wake-up, however slow
    assert computing(0.03, 0.2, 0.2, SAMPLE_SHARE) and not computing(0.01, 0.2, 0.2, SAMPLE_SHARE)
    share = WINDOW_SHARE * 1.5  # a native call on a loaded machine: under SAMPLE_SHARE in each sample
    watch = _Readings(interval=0.2)
    assert all(watch.step(0.2, cpu=share * 0.2) for _ in range(20))
    watch = _Readings(interval=0.2)
    assert not any(watch.step(0.2, cpu=WINDOW_SHARE * 0.2 / 2) for _ in range(9))  # a fiftieth of a core, halved
    assert watch.step(0.2, cpu=0.2)  # then it computes: at once
    watch = _Readings(interval=1.0)  # the default stall_timeout's interval: 120 samples a stall window
    assert not any(watch.step(1.0, cpu=0.0005) for _ in range(120))  # a sleep(0.01) loop's wake-ups
    watch = _Readings(interval=1.0)
    assert not any(watch.step(1.0, IN_C10D) for _ in range(100))  # 100 s in a collective, then computing
    assert [watch.step(1.0, cpu=0.5) for _ in range(2)] == [True, True]  # half a core: at once


def test_progress_reads_a_threads_signals() -> None:
    """A real thread watched from another, as the sampler watches the main thread: its CPU time,
    its I/O and the CPU time of a thread it waits on are read, and each is progress (what the
    thread does cannot fail to show: each check is a lower bound on the counters it moved)."""
    import queue
    import threading

    from spark_torch.rank.progress_signals import Progress

    orders: queue.Queue[str] = queue.Queue()
    done: queue.Queue[bool] = queue.Queue()

    def worker() -> None:
        while (order := orders.get()) != "end":
            if order == "compute":
                _compute(0.1)
            if order == "write":
                with open(os.devnull, "w") as fh:
                    fh.write("x")
            done.put(True)

    thread = threading.Thread(target=worker)
    thread.start()
    progress = Progress(thread.ident or 0, thread.native_id or 0, interval=0.05)

    def step(order: str) -> tuple[Any, Any]:
        before = progress.read()
        orders.put(order)
        done.get(timeout=30)
        return before, progress.read()

    try:
        before, after = step("compute")
        assert after.cpu - before.cpu >= 0.1 and progress.judge(after, tuple(HERE), 10, HERE)
        before, after = step("write")
        assert after.io[1] > before.io[1] and progress.judge(after, tuple(HERE), 10, HERE)
        helper = threading.Thread(target=_compute, args=(0.1,))
        before = progress.read()
        helper.start()
        helper.join()
        after = progress.read()
        assert after.others - before.others >= 0.1
        assert progress.judge(after, tuple(HERE), 10, HERE, waits_on_a_thread=True)
    finally:
        orders.put("end")
        thread.join(30)


def test_a_new_position_an_upload_and_another_threads_bytes_are_progress() -> None:
    """The signals beside CPU time and the thread's own I/O, on an idle watched thread, in a
    process of its own: the other threads' CPU and bytes are signals, so the pytest worker's own
    threads (xdist's report pipe, a Spark session's py4j threads) would be counted too (seen:
    the last check failed in a worker that had run Spark tests)."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    code = "from tests.unit.test_stacks import other_threads_signals; other_threads_signals()"
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def other_threads_signals() -> None:
    """The checks of the test above, in a process with no other thread than the ones made here."""
    import threading

    from spark_torch.rank.progress_signals import OTHERS_IO_BYTES, Progress, collective_count
    from spark_torch.shared.stacks import working

    idle = threading.Event()
    thread = threading.Thread(target=idle.wait)
    thread.start()
    progress = Progress(thread.ident or 0, thread.native_id or 0, interval=0.2)
    here, there = [("/job/train.py", 1, "train")], [("/job/train.py", 2, "train")]

    def moves_bytes(size: int) -> None:
        with open(os.devnull, "wb") as fh:
            fh.write(b"x" * size)

    try:
        assert not progress.moved(tuple(here), 0, here)  # the first position is no progress
        assert progress.moved(tuple(there), 0, there)  # a position never seen before is
        assert not progress.moved(tuple(here), 0, here)  # one seen before is not
        with working():  # report()'s upload, however long it waits
            assert progress.moved(tuple(here), 0, here)
        assert not progress.moved(tuple(here), 0, here)
        for waits in (False, True):  # another thread moves data while the watched one waits on it
            helper = threading.Thread(target=moves_bytes, args=(4 * OTHERS_IO_BYTES,))
            helper.start()
            helper.join()
            assert progress.moved(tuple(here), 0, here, waits_on_a_thread=waits) is waits
        # under OTHERS_IO_BYTES (a store's polling, a heartbeat thread) is none, even waited on; the
        # pause makes the helper's microseconds of CPU far less than a tenth of the interval
        helper = threading.Thread(target=moves_bytes, args=(OTHERS_IO_BYTES // 4,))
        helper.start()
        helper.join()
        time.sleep(0.5)
        assert not progress.moved(tuple(here), 0, here, waits_on_a_thread=True)
    finally:
        idle.set()
        thread.join(30)
    assert collective_count() in (None, 0)  # no process group in this process


def test_long_stacks_are_cut_on_frame_boundaries() -> None:
    frames = "".join(
        f'  File "train.py", line {i}, in deep\n    token = "secret-{i}"  # a source line\n' for i in range(300)
    )
    tail = cut_tail(frames, 2_000)
    assert (
        len(tail) <= 2_000
        and tail.startswith('  ...\n  File "train.py", line ')
        and tail.endswith('"secret-299"  # a source line\n')
    )
    assert all(line.startswith(("  ...", '  File "', '    token = "secret-')) for line in tail.splitlines()), tail
    head = cut_head(frames, 2_000)
    assert len(head) <= 2_000 and head.startswith('  File "train.py", line 0,') and head.endswith("# a source line\n")
    assert cut_tail("short", 10) == "short" == cut_head("short", 10)
    assert strip_source_lines(tail).count("secret") == 0  # whole lines: stripping leaves no fragment
    # a node's text past the limit keeps whole lines too
    assert RankStack.from_dict({"rank": 0, "text": "x" * 10 + "\n" + frames * 2}).text.endswith("# a source line\n")


def test_report_deadlock_needs_ranks_in_report_and_every_other_rank_waiting_in_a_collective() -> None:
    from spark_torch.shared.stacks import report_deadlock

    in_report = RankStack(0, IN_REPORT, 6.0)
    in_reduce = RankStack(1, IN_REDUCE, 6.0)
    assert report_deadlock([in_report, in_reduce], after=5.0) == ([0], [in_reduce])
    assert report_deadlock([in_report, RankStack(1, IN_REDUCE, 4.0)], after=5.0) is None  # not long enough
    assert report_deadlock([in_report, RankStack(1, LOAD, 60.0)], after=5.0) is None  # elsewhere, not a collective
    assert report_deadlock([RankStack(0, IN_REPORT, 6.0), RankStack(1, IN_REPORT, 6.0)], after=5.0) is None  # all there
    assert report_deadlock([in_report, RankStack(1, IN_REDUCE, 60.0, StackState.NOT_ANSWERING)], after=5.0) is None
    assert report_deadlock([in_report, RankStack(1, IN_REDUCE, 6.0, StackState.EXITED)], after=5.0) is None
