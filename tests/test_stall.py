"""Stall detection end to end: real Spark, real gloo, both modes, warm and cold rank starts.

Rank 1 blocks in a function of its own (``wait_for_the_loader``) while rank 0 waits in
all_reduce: the shape of the most common distributed hang.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from spark_torch import AttemptEnd, AttemptReason, Distributor, RunStalledError, RunTimeoutError
from spark_torch.reporting.storage import RunStorage
from tests.conftest import SCRIPTS
from tests.stall_programs import (
    fails_once_after_a_checkpoint,
    heartbeat_beside_a_hang,
    holds_the_gil_from_its_first_step,
    in_report,
    loader_stuck,
    main_joins_a_stuck_thread,
    native_compute,
    one_rank_holds_the_gil,
    one_rank_stops_itself,
    one_rank_stuck,
    silent_compute,
    sleeps_holding_the_gil,
    stuck_once_after_a_checkpoint,
    waits_between_collectives,
    waits_in_a_loop,
    works_elsewhere,
)

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
        num_processes=2,
        local_mode=local == "local",
        spark=None if local == "local" else spark,
        warm_start=warm == "warm",
        log_ranks=[],
        **kwargs,
    )


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
    assert "in one_rank_stuck\n    dist.all_reduce(t)" in first  # file:line and the user's source line
    assert len(warnings) == 1, warnings  # the stacks once per stall (README: "one warning shows every rank's stack")
    reminders = [r for r in caplog.records if r.getMessage().startswith("spark_torch: still stalled after")]
    assert reminders and all(r.getMessage().endswith("s; ranks unchanged") for r in reminders)
    times = [r.created for r in _stall_records(caplog) + reminders]  # at most once per stall_timeout while it lasts
    assert all(later - earlier >= TIMEOUT * 0.9 for earlier, later in zip(times, times[1:])), times
    assert len(_moved_again(caplog)) == 1
    assert re.fullmatch(r"spark_torch: the run moves again after \d+s without progress", _moved_again(caplog)[0])
    # torch's Flight Recorder (gloo records too): what each rank had in flight, and its JSON dump
    recorder = [
        r.getMessage() for r in caplog.records if "Flight Recorder, the collectives in flight" in r.getMessage()
    ]
    assert recorder, "no Flight Recorder summary"
    assert "rank 0: gloo:all_reduce #" in recorder[0] and "rank 1: no collective in flight" in recorder[0], recorder
    traces = tmp_path / "flight-recorder" / "attempt-0"
    assert sorted(p.name for p in traces.iterdir()) == ["rank_0.json", "rank_1.json"]
    assert json.loads((traces / "rank_0.json").read_text())["entries"][0]["profiling_name"] == "gloo:all_reduce"


@pytest.mark.parametrize("mode", ["local-warm", "distributed-cold"])
def test_fail_stops_the_run_with_both_stacks(mode: str, spark_session: Any, caplog: Any, no_leftovers: None) -> None:
    with caplog.at_level(logging.WARNING, logger="spark_torch"), pytest.raises(RunStalledError) as info:
        _distributor(mode, spark_session, stall_action="fail").run(one_rank_stuck, 3600)
    # from the stall's warning to the error: the stop itself (a barrier stage's start on a loaded
    # machine is no part of it)
    found = [r.created for r in _stall_records(caplog) if "stall_action='fail': stopping the run" in r.getMessage()]
    assert len(found) == 1, _stall_warnings(caplog)
    took = time.time() - found[0]
    error = info.value
    message = str(error)
    assert "no rank made progress" in message and "stall_action='fail'" in message
    assert "rank 0: in all_reduce" in message and "rank 1: in wait_for_the_loader" in message, message
    assert set(error.stacks) == {0, 1} and "wait_for_the_loader" in error.stacks[1]
    assert "rank 0: gloo:all_reduce #" in message and "rank 1: no collective in flight" in message, message
    assert took < TIMEOUT + 30, took  # seconds after the stall, not the 30 min of a collective's timeout
    logged = [r.getMessage() for r in caplog.records if r.name.startswith("spark_torch")]
    assert not [m for m in logged if "wait_for_the_loader" in m], logged  # the stacks once: in the error


@pytest.mark.parametrize("mode", ["local-warm", "distributed-warm"])
def test_ranks_that_compute_silently_are_not_stalled(mode: str, spark_session: Any, caplog: Any) -> None:
    # a longer timeout than the other tests: on a loaded 2-core machine the node's reports can
    # lag a second or two, and this test is about the ranks, not about how late a report comes
    timeout = 2 * TIMEOUT
    with caplog.at_level(logging.WARNING, logger="spark_torch"):
        assert _distributor(mode, spark_session, stall_timeout=timeout).run(silent_compute, 4 * timeout) == 2
    assert not _stall_warnings(caplog)


@pytest.mark.parametrize("mode", ["local-warm", "distributed-warm"])
def test_ranks_whose_collectives_complete_are_never_stalled(mode: str, spark_session: Any, caplog: Any) -> None:
    # main threads that mostly wait (a 0.3 s and a 0.05 s sleepy step, a loader thread feeding
    # the main thread, a pipeline stage in recv), each shape longer than stall_timeout, with
    # stall_action="fail": the collectives they complete are their progress
    timeout = 1.5 * TIMEOUT  # a few tenths of a second of slack for a loaded machine's late reports
    distributor = _distributor(mode, spark_session, stall_timeout=timeout, stall_action="fail")
    with caplog.at_level(logging.WARNING, logger="spark_torch"):
        assert distributor.run(waits_between_collectives, timeout + 1) > 0  # no RunStalledError
    assert not _stall_warnings(caplog)


def test_work_outside_the_main_thread_is_progress(tmp_path: Path, caplog: Any) -> None:
    # a busy child, a computing pool, a slow report() upload, a rank that returned while its
    # keeper still stops what it left: each longer than stall_timeout, with stall_action="fail"
    distributor = Distributor(
        num_processes=2, stall_timeout=TIMEOUT, stall_action="fail", storage_path=tmp_path, log_ranks=[]
    )
    with caplog.at_level(logging.WARNING, logger="spark_torch"):
        assert distributor.run(works_elsewhere, 2 * TIMEOUT) == 8  # no RunStalledError
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


def test_the_cli_says_each_stalls_stacks_once(tmp_path: Path, no_leftovers: None) -> None:
    """``spark-torch run --stall-action fail --max-restarts 1``: two stalls, each one's stacks said
    once (the first in the "restarting" warning, the second in the error), the line that says the
    run is stopped once per stall, and each stall's Flight Recorder block once (the traces are
    waited for, so the message that holds the stacks holds them)."""
    env = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=sys.executable)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "spark_torch",
            "run",
            "-n",
            "2",
            "--stall-timeout",
            f"{TIMEOUT:g}",
            "--stall-action",
            "fail",
            "--max-restarts",
            "1",
            "--log-dir",
            str(tmp_path),
            str(SCRIPTS / "stall_script.py"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert out.count("rank 1: in wait_for_the_loader") == 2, out
    assert out.count("stall_action='fail': stopping the run") == 2, out
    assert out.count("restarting the gang (1 of 1)\nWhere each rank was:") == 1, out
    assert "spark-torch: error: the run stalled" in out, out
    blocks = out.count("the collectives in flight on each rank")
    assert blocks == 2 or (blocks > 2 and "(no trace" in out), out  # a third only for traces that came late


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
    assert attempts[0].error is not None and attempts[0].error.type_name == "RunStalledError"
    assert "no rank made progress" in (attempts[0].detail or "")
    assert distributor.last_run.metrics_dataframe["epoch"].tolist() == [1, 2, 3]


@pytest.mark.parametrize("mode", ["local-warm", "distributed-warm"])
def test_a_rank_holding_the_gil_shows_its_true_stack_when_stopped(
    mode: str, spark_session: Any, no_leftovers: None
) -> None:
    # its sampler cannot run; the run is stopped (stall_action="fail"), so faulthandler is asked
    # (in distributed mode through the channel's trace request marked "stopping")
    distributor = _distributor(mode, spark_session, stall_action="fail")
    with pytest.raises(RunStalledError) as info:
        distributor.run(one_rank_holds_the_gil, 60)
    message = str(info.value)
    assert "rank 1: in hold_the_gil (not answering for" in message and "ctypes.PyDLL(None).read(" in message, message
    assert "rank 0: in all_reduce" in message


def test_looking_at_a_rank_holding_the_gil_never_interrupts_it(caplog: Any, no_leftovers: None) -> None:
    # warn mode: the run goes on, so no signal reaches the rank; libc's sleep returns 0 (a
    # signal would have cut it short: it returns the seconds left)
    with caplog.at_level(logging.WARNING, logger="spark_torch"):
        assert (
            Distributor(num_processes=2, stall_timeout=TIMEOUT, log_ranks=[]).run(
                sleeps_holding_the_gil, 3 * int(TIMEOUT)
            )
            == 0
        )
    warnings = _stall_warnings(caplog)
    shown = [w for w in warnings if "rank 1: in sleeps_holding_the_gil (not answering for" in w]
    assert shown and "its last sampled stack" in shown[0] and "rank 0: in all_reduce" in shown[0], warnings


def test_a_rank_holding_the_gil_from_its_first_step_is_shown(tmp_path: Path, caplog: Any, no_leftovers: None) -> None:
    # its sampler started (record 0) and never sampled: not set-up, a stall within 2 x stall_timeout
    note = tmp_path / "rank1.json"
    with caplog.at_level(logging.WARNING, logger="spark_torch"):
        assert (
            Distributor(num_processes=2, stall_timeout=TIMEOUT, log_ranks=[]).run(
                holds_the_gil_from_its_first_step, 3 * int(TIMEOUT), str(note)
            )
            == 2
        )
    entered = json.loads(note.read_text())
    assert entered["seq"] in (0, None), (
        f"rank 1 was sampled before its native call: not the case this test is about ({entered})"
    )
    shown = [r for r in _stall_records(caplog) if "rank 1 (has not answered since it started" in r.getMessage()]
    assert shown, _stall_warnings(caplog)
    assert "a native call may hold the GIL" in shown[0].getMessage()
    assert shown[0].created - entered["time"] < 2 * TIMEOUT, shown[0].created - entered["time"]


#: longer than a DataLoader's 5 s poll of its workers (the issue's case: found at 4, never at 8)
POLL_TIMEOUT = 8.0
#: hangs in which the stuck rank polls: (program, argument, what the message must show)
POLLING_HANGS = {
    "data-loader": (
        loader_stuck,
        1,
        ["threading.Event().wait()  # the data-loader deadlock", "for batch in DataLoader("],
    ),
    "event-wait-loop": (waits_in_a_loop, 10_000, ["rank 1: in waits_in_a_loop", "if done.wait(1):"]),
    "heartbeat": (heartbeat_beside_a_hang, 3600, ["rank 1: in wait_for_the_loader", "heartbeat"]),
}


@pytest.mark.parametrize("hang", sorted(POLLING_HANGS))
@pytest.mark.parametrize("mode", ["local-warm", "distributed-warm"])
def test_a_rank_that_only_polls_is_stalled(mode: str, hang: str, spark_session: Any, no_leftovers: None) -> None:
    program, argument, shown = POLLING_HANGS[hang]
    start = time.monotonic()
    with pytest.raises(RunStalledError) as info:  # not RunTimeoutError: the stall is found
        _distributor(mode, spark_session, stall_timeout=POLL_TIMEOUT, stall_action="fail", timeout=240).run(
            program, argument
        )
    took = time.monotonic() - start
    message = str(info.value)
    for text in shown:
        assert text in message, message
    assert "rank 0: in all_reduce" in message, message
    assert took < 120, took  # stall_timeout and a few seconds (and a loaded machine), not the run's timeout


def test_a_native_call_that_computes_is_not_a_stall(no_leftovers: None) -> None:
    distributor = Distributor(num_processes=2, stall_timeout=TIMEOUT, stall_action="fail", log_ranks=[])
    assert distributor.run(native_compute, 3 * TIMEOUT) == 2  # no RunStalledError


def test_a_slow_resume_download_is_set_up_not_a_stall(tmp_path: Path, monkeypatch: Any, no_leftovers: None) -> None:
    download = RunStorage.download

    def slow(self: RunStorage, checkpoint: Any, local_dir: str) -> str:
        done = threading.Event()  # the download of a big checkpoint: 3 x stall_timeout
        done.wait(3 * TIMEOUT)
        return download(self, checkpoint, local_dir)

    monkeypatch.setattr(RunStorage, "download", slow)
    distributor = Distributor(
        num_processes=2, stall_timeout=TIMEOUT, stall_action="fail", max_restarts=1, storage_path=tmp_path, log_ranks=[]
    )
    assert distributor.run(fails_once_after_a_checkpoint, 2) == {"resumed_from": 1, "attempt": 1}
    assert [a.end for a in distributor.last_run.attempts] == [AttemptEnd.FAILED, AttemptEnd.SUCCEEDED]


def test_a_rank_in_report_is_shown_as_in_report(caplog: Any, no_leftovers: None) -> None:
    with caplog.at_level(logging.WARNING, logger="spark_torch"):
        assert Distributor(num_processes=2, stall_timeout=TIMEOUT, log_ranks=[]).run(in_report, 4 * TIMEOUT) == 1
    warnings = _stall_warnings(caplog)
    assert warnings and "rank 0: in spark_torch.report()" in warnings[0], warnings
    assert "_answer_for" not in warnings[0]


def test_a_stopped_rank_is_named_stopped(no_leftovers: None) -> None:
    distributor = Distributor(num_processes=2, stall_timeout=TIMEOUT, stall_action="fail", log_ranks=[])
    with pytest.raises(RunStalledError) as info:
        distributor.run(one_rank_stops_itself, 1.0)
    message = str(info.value)
    assert "rank 1: in one_rank_stops_itself (its process is stopped" in message, message
    assert "GIL" not in message


def test_the_sampler_keeps_no_local_alive(tmp_path: Path) -> None:
    """A tensor the main thread deletes is freed at once while the sampler samples at its fastest."""
    script = tmp_path / "keeps.py"
    script.write_text(SAMPLER_PROBE)
    env = {**os.environ, "SPARK_TORCH_STACK_FILE": str(tmp_path / "stack.json"), "SPARK_TORCH_SAMPLE_SECONDS": "0.05"}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "freed 20 of 20", done.stdout + done.stderr


SAMPLER_PROBE = """
import json, os, time, weakref
import torch
from spark_torch.rank.sampler import start_sampler

def seq():
    try:
        with open(os.environ["SPARK_TORCH_STACK_FILE"]) as fh:
            return json.load(fh)["seq"]
    except (OSError, ValueError):
        return 0

def one_round():
    activations = torch.ones(1000)
    ref = weakref.ref(activations)
    first = seq()
    deadline = time.monotonic() + 30
    while seq() < first + 2:  # sampled at least twice while alive (a busy loop: sampled at its jump)
        assert time.monotonic() < deadline, "the sampler did not sample"
    del activations
    return ref() is None

start_sampler()
print(f"freed {sum(one_round() for _ in range(20))} of 20")
"""


@pytest.mark.parametrize("source_lines", ["0", "1"])
def test_a_deep_stack_is_cut_on_frame_boundaries_after_its_source_lines_are_left_out(
    tmp_path: Path, source_lines: str
) -> None:
    """A rank 300 frames deep whose lines hold a token: with stall_source_lines=False no part of
    any source line is in what its sampler writes; with them, the cut keeps whole frames."""
    script = tmp_path / "deep.py"
    script.write_text(DEEP_PROBE)
    stack = tmp_path / "stack.json"
    env = {
        **os.environ,
        "SPARK_TORCH_STACK_FILE": str(stack),
        "SPARK_TORCH_SAMPLE_SECONDS": "0.05",
        "SPARK_TORCH_STACK_SOURCE_LINES": source_lines,
        "DEEP_SEEN": str(tmp_path / "seen.json"),
    }
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    text = json.loads((tmp_path / "seen.json").read_text())["stack"]  # what the sampler wrote while it was deep
    assert text.startswith('  ...\n  File "'), text[:200]  # cut: its outer frames dropped whole
    assert text.count(", in deep\n") > 50
    if source_lines == "0":
        assert "TOKEN" not in text and "secret" not in text, text[:400]
    else:
        assert all(line.startswith(("  ...", '  File "', "    ")) for line in text.splitlines())
        assert 'return deep(n - 1, token="TOKEN-secret")' in text


DEEP_PROBE = """
import json, os, sys, time
from spark_torch.rank.sampler import start_sampler

def deep(n, token=""):
    if n:
        return deep(n - 1, token="TOKEN-secret")  # a source line that must never leak, even in part
    first = None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # sampled at least twice down here
        try:
            with open(os.environ["SPARK_TORCH_STACK_FILE"]) as fh:
                written = fh.read()
            seq = json.loads(written)["seq"]
        except (OSError, ValueError):
            seq = 0
        first = seq if first is None else first
        if seq >= first + 2 and seq > 1:
            # kept from down here: the sampler goes on sampling this process's exit (coverage.py
            # saving its data, under make coverage) after deep() returns
            with open(os.environ["DEEP_SEEN"], "w") as fh:
                fh.write(written)
            return token
    raise SystemExit("the sampler did not sample")

sys.setrecursionlimit(2000)
start_sampler()
deep(300)
"""


def test_a_timeout_during_a_stall_shows_the_stacks_once(caplog: Any, no_leftovers: None) -> None:
    with caplog.at_level(logging.WARNING, logger="spark_torch"), pytest.raises(RunTimeoutError) as info:
        Distributor(num_processes=2, stall_timeout=TIMEOUT, timeout=4 * TIMEOUT, log_ranks=[]).run(one_rank_stuck, 3600)
    assert "rank 1: in wait_for_the_loader" in str(info.value)
    assert not _moved_again(caplog), _moved_again(caplog)  # it was stopped, it did not move
    assert len(_stall_warnings(caplog)) == 1


def test_source_lines_can_be_left_out(no_leftovers: None) -> None:
    distributor = Distributor(
        num_processes=2, stall_timeout=TIMEOUT, stall_action="fail", stall_source_lines=False, log_ranks=[]
    )
    with pytest.raises(RunStalledError) as info:
        distributor.run(one_rank_stuck, 3600)
    message = str(info.value)
    assert "rank 1: in wait_for_the_loader" in message and ", in one_rank_stuck\n" in message, message
    assert "dist.all_reduce(t)" not in message and "time.sleep(seconds)" not in message, message
    assert "dist.all_reduce(t)" not in info.value.stacks[0]


def test_the_thread_the_main_thread_waits_on_is_shown(no_leftovers: None) -> None:
    distributor = Distributor(num_processes=2, stall_timeout=TIMEOUT, stall_action="fail", log_ranks=[])
    with pytest.raises(RunStalledError) as info:
        distributor.run(main_joins_a_stuck_thread, 3600)
    stack = info.value.stacks[1]
    assert "worker.join()" in stack and "Thread fetcher:" in stack and "in fetch_in_a_thread" in stack, stack
