"""torch's Flight Recorder on a stall: the summary (real gloo ranks: mismatched collectives, a
skipped one, a long run's record cut to its tail, a rank that does not answer), the dump's format
for ``torchfrtrace``, the trace files' checks (FIFO, hard link, symbolic link, a folder of another
user or one others may write to), untrusted JSON, and the writer off the channel's thread.
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

from spark_torch import DistributedRunError, Distributor
from spark_torch.driver.run import flight_recorder
from spark_torch.driver.run.flight_recorder import FlightRecorder, TraceDir, trace_dir
from spark_torch.driver.run.stall import StallWatch
from spark_torch.shared.fr_dumps import keep_tail, rank_line, read_dump, summary
from spark_torch.shared.stacks import MAX_TRACE_BYTES
from tests.conftest import SCRIPTS, TESTS
from tests.fr_programs import stuck_then_talks

#: how long the gloo ranks of one dump may take (a loaded 2-core machine)
RANKS_SECONDS = 180.0
#: how long the writer may take to store a trace that arrived
STORED_SECONDS = 30.0


def _gloo_dumps(folder: Path, world: int, count: int, mode: str) -> dict[int, bytes]:
    """Run ``world`` real gloo ranks of tests/scripts/fr_dump.py; their dumps by rank."""
    store = folder / "store"
    procs = [
        subprocess.Popen(
            [sys.executable, str(SCRIPTS / "fr_dump.py"), str(r), str(world), str(store), str(folder), str(count), mode]
        )
        for r in range(world)
    ]
    try:
        for proc in procs:
            assert proc.wait(RANKS_SECONDS) == 0, f"fr_dump.py rank exited {proc.returncode}: see its stderr above"
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return {r: (folder / f"rank_{r}.json").read_bytes() for r in range(world)}


@pytest.fixture(scope="module")
def mismatched(tmp_path_factory: pytest.TempPathFactory) -> dict[int, bytes]:
    """Rank 0's collective #21 is an all_reduce, rank 1's a broadcast; both wait forever."""
    return _gloo_dumps(tmp_path_factory.mktemp("mismatch"), 2, 20, "mismatch")


def test_mismatched_collectives_are_named_in_one_line(mismatched: dict[int, bytes]) -> None:
    lines = summary({r: read_dump(d) for r, d in mismatched.items()})
    assert lines[0] == "collective #21: rank 0 all_reduce [4], rank 1 broadcast [4]", lines
    assert "rank 0: gloo:all_reduce #21 in flight, sizes [4]" in lines, lines
    assert "rank 1: gloo:broadcast #21 in flight, sizes [4]" in lines, lines
    assert not any("#20 in flight" in line for line in lines), lines  # the 20 completed ones are not in flight
    page = (TESTS.parent / "docs" / "troubleshooting.md").read_text()
    shown = next(block for block in re.findall(r"```text\n(.*?)```", page, re.S) if "collective #21" in block)
    assert shown.splitlines() == lines  # docs/troubleshooting.md shows this run's summary


def test_a_rank_that_does_not_answer_leaves_the_others_summary(tmp_path: Path) -> None:
    dumps = _gloo_dumps(tmp_path, 3, 5, "skip")  # rank 1 skips collective #6
    lines = summary({r: read_dump(d) for r, d in dumps.items()})
    assert lines[0] == "rank 1 is at #5, the others at #6", lines
    assert "rank 1: no collective in flight (last: gloo:all_reduce #5, completed)" in lines, lines
    lines = summary({0: read_dump(dumps[0]), 1: read_dump(dumps[1]), 2: None})
    assert lines[0] == "rank 1 is at #5, rank 0 at #6", lines
    assert lines[-1] == "rank 2: no trace (it did not answer)", lines


def test_a_long_runs_record_keeps_its_tail(tmp_path: Path) -> None:
    dumps = _gloo_dumps(tmp_path, 2, 1500, "skip")
    assert all(len(d) > MAX_TRACE_BYTES for d in dumps.values()), [len(d) for d in dumps.values()]
    cut = {r: keep_tail(d, MAX_TRACE_BYTES) for r, d in dumps.items()}
    assert all(len(d) <= MAX_TRACE_BYTES for d in cut.values())
    assert json.loads(cut[0])["entries"][-1]["collective_seq_id"] == 1501  # the newest entries stay
    lines = summary({r: read_dump(d) for r, d in cut.items()})
    assert lines[0] == "rank 1 is at #1500, rank 0 at #1501", lines
    assert re.match(r"rank 0: gloo:all_reduce #1501 in flight, sizes \[4\] \[\d+ older entries cut\]$", lines[1]), lines


def _doc_converter() -> Any:
    """docs/troubleshooting.md's ``to_torchfrtrace``, as the page has it."""
    page = (TESTS.parent / "docs" / "troubleshooting.md").read_text()
    code = next(block for block in re.findall(r"```python\n(.*?)```", page, re.S) if "def to_torchfrtrace" in block)
    namespace: dict[str, Any] = {}
    exec(compile(code, "troubleshooting.md", "exec"), namespace)  # noqa: S102 - the page's own code
    return namespace["to_torchfrtrace"]


def test_the_docs_conversion_feeds_torchfrtrace(mismatched: dict[int, bytes], tmp_path: Path) -> None:
    for rank, data in mismatched.items():
        (tmp_path / f"rank_{rank}.json").write_bytes(data)
    _doc_converter()(str(tmp_path), str(tmp_path / "out"))
    analysed = subprocess.run(
        [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=RANKS_SECONDS,
    )
    assert analysed.returncode == 0, analysed.stderr[-2000:]
    said = analysed.stdout + analysed.stderr  # torch logs its findings
    assert "Culprit rank 1; Error type: COLLECTIVE_TYPE_MISMATCH" in said, said[-2000:]


@pytest.mark.parametrize(
    "data",
    [
        b'{"entries": 5}',
        b"[" * 100_000,
        b'{"entries": [5, null, {"collective_seq_id": true}, {"collective_seq_id": 3, "input_sizes": [[1, "x"]]}]}',
        b"\x80\x04pickled",
        b'"entries"',
        b'{"entries": [{"collective_seq_id": 1, "profiling_name": "' + b"x" * 10_000 + b'"}]}',
    ],
    ids=["entries-not-a-list", "deep-nesting", "bad-fields", "a-pickle", "a-string", "huge-name"],
)
def test_bad_dumps_are_read_without_a_raise(data: bytes, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    dump = read_dump(data)
    lines = summary({0: dump, 1: None})
    assert all(len(line) < 400 for line in lines), lines
    recorder = FlightRecorder(2, TraceDir(str(tmp_path), ("traces",)))
    with caplog.at_level(logging.DEBUG, logger="spark_torch"):
        recorder.receive(0, data)
        recorder.receive("0", data)  # a rank that is not a rank
        recorder.receive(True, data)
        recorder.receive(0, "text, not bytes")
        recorder.ask(lambda: None, {0}, STORED_SECONDS)
        note = recorder.note()
        recorder.close()
    assert "rank 0: " in note and "rank 1" not in note, note
    assert (tmp_path / "traces" / "rank_0.json").read_bytes() == data
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records]


def test_a_trace_too_large_is_dropped_not_stored(tmp_path: Path) -> None:
    recorder = FlightRecorder(1, TraceDir(str(tmp_path), ("traces",)))
    recorder.receive(0, b" " * (MAX_TRACE_BYTES + 1))
    recorder.close()
    assert not (tmp_path / "traces").exists()


def _summaries(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "the collectives in flight on each rank" in r.getMessage()]


def test_the_summary_is_said_once_per_request(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A stall message that held the whole summary (fail: the traces waited for) is not followed
    by a logged one; a message said before every trace came (warn: no wait) is, once."""
    trace = b'{"entries": []}'
    with caplog.at_level(logging.WARNING, logger="spark_torch"):
        recorder = FlightRecorder(2, TraceDir(str(tmp_path), ("held",)))
        recorder.receive(0, trace)
        recorder.receive(1, trace)
        recorder.ask(lambda: None, {0, 1}, STORED_SECONDS)  # both came within the wait
        held = recorder.note()
        recorder.close()
        assert "rank 0: no collective in flight" in held and "rank 1: no collective in flight" in held, held
        assert _summaries(caplog) == []  # the message that holds it is the one place it is said

        recorder = FlightRecorder(2, TraceDir(str(tmp_path), ("late",)))
        recorder.ask(lambda: None, {0, 1}, 0.0)  # warn: no wait
        early = recorder.note()  # said before any trace came: where they go
        assert "go to" in early and "rank 0" not in early, early
        recorder.receive(0, trace)
        recorder.receive(1, trace)
        deadline = time.monotonic() + STORED_SECONDS
        while not _summaries(caplog) and time.monotonic() < deadline:
            time.sleep(0.05)
        recorder.receive(1, trace)  # a rank's trace again: the request was answered, nothing more is said
        recorder.close()
    said = _summaries(caplog)
    assert len(said) == 1 and "rank 1: no collective in flight" in said[0], said


def _store(tmp_path: Path, where: TraceDir, caplog: pytest.LogCaptureFixture) -> list[str]:
    """One trace through a recorder; the warnings it logged."""
    recorder = FlightRecorder(1, where)
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="spark_torch"):
        recorder.receive(0, b'{"entries": []}')
        recorder.ask(lambda: None, {0}, STORED_SECONDS)
        recorder.close()
    assert time.monotonic() - start < STORED_SECONDS  # nothing planted blocks the writer
    return [r.getMessage() for r in caplog.records if "not written" in r.getMessage()]


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    path = tmp_path / "victim"
    path.write_text("precious")
    return path


def _planted(tmp_path: Path) -> Path:
    folder = tmp_path / "logs" / "flight-recorder" / "attempt-0"
    folder.mkdir(parents=True, mode=0o700)
    return folder / "rank_0.json"


def test_a_fifo_at_the_trace_file_is_refused(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    os.mkfifo(_planted(tmp_path))
    warnings = _store(tmp_path, trace_dir(str(tmp_path / "logs"), "run", 0), caplog)
    assert len(warnings) == 1 and "rank_0.json is a named pipe (FIFO), not a regular file" in warnings[0], warnings
    assert "choose another log_dir" in warnings[0]


def test_a_hard_link_at_the_trace_file_is_refused(
    tmp_path: Path, victim: Path, caplog: pytest.LogCaptureFixture
) -> None:
    os.link(victim, _planted(tmp_path))
    warnings = _store(tmp_path, trace_dir(str(tmp_path / "logs"), "run", 0), caplog)
    assert len(warnings) == 1 and "rank_0.json has 2 names (a hard link" in warnings[0], warnings
    assert victim.read_text() == "precious"  # not truncated


def test_a_symbolic_link_at_the_trace_file_is_refused(
    tmp_path: Path, victim: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _planted(tmp_path).symlink_to(victim)
    warnings = _store(tmp_path, trace_dir(str(tmp_path / "logs"), "run", 0), caplog)
    assert len(warnings) == 1 and "rank_0.json is a symbolic link" in warnings[0], warnings
    assert victim.read_text() == "precious"


def test_a_folder_others_may_write_to_is_refused(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    folder = tmp_path / "logs" / "flight-recorder"
    folder.mkdir(parents=True)
    folder.chmod(0o775)
    warnings = _store(tmp_path, trace_dir(str(tmp_path / "logs"), "run", 0), caplog)
    assert (
        len(warnings) == 1 and "flight-recorder is not a folder of this user that only it may write to" in warnings[0]
    )
    assert not (folder / "attempt-0").exists()


@pytest.mark.skipif(os.getuid() != 0, reason="making a folder of another user needs root")
def test_a_folder_of_another_user_is_refused(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    folder = tmp_path / "logs" / "flight-recorder"
    folder.mkdir(parents=True, mode=0o700)
    os.chown(folder, 4242, 4242)
    warnings = _store(tmp_path, trace_dir(str(tmp_path / "logs"), "run", 0), caplog)
    assert len(warnings) == 1 and "(owner uid 4242" in warnings[0], warnings


def test_without_log_dir_a_private_folder_of_this_user(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    monkeypatch.setattr("spark_torch.shared.owned_files._fallbacks", {})
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    where = trace_dir(None, "run-1", 3)
    mine = tmp_path / f"spark_torch_traces-{os.getuid()}"
    assert where is not None and where.path == str(mine / "run-1" / "attempt-3")
    assert _store(tmp_path, where, caplog) == []
    assert (mine / "run-1" / "attempt-3" / "rank_0.json").read_bytes() == b'{"entries": []}'
    assert mine.stat().st_mode & 0o777 == 0o700
    mine.chmod(0o755)  # readable by others: a shared folder, not this user's own
    with caplog.at_level(logging.WARNING, logger="spark_torch"):
        where = trace_dir(None, "run-2", 0)
        assert trace_dir(None, "run-3", 0) is not None  # one warning per process
    refused = [r.getMessage() for r in caplog.records if "refused the folder" in r.getMessage()]
    assert len(refused) == 1 and f"{mine} (is not a folder of this user that only it may use" in refused[0], refused
    assert where is not None and not where.path.startswith(str(mine) + os.sep)
    assert _store(tmp_path, where, caplog) == []  # written to the private folder instead
    assert os.path.isfile(os.path.join(where.path, "rank_0.json")) and list((mine / "run-1").iterdir())
    folder = Path(where.root) / where.parts[0]
    assert folder.stat().st_uid == os.getuid() and folder.stat().st_mode & 0o777 == 0o700
    assert f"private folder {folder} instead" in refused[0]


@pytest.mark.skipif(os.getuid() != 0, reason="making a folder of another user needs root")
def test_a_per_user_folder_of_another_user_is_never_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Another user made ``spark_torch_traces-UID`` first: traces go to
    ``$XDG_RUNTIME_DIR/spark_torch_traces`` when that is this user's, with one WARNING."""
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    monkeypatch.setattr("spark_torch.shared.owned_files._fallbacks", {})
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    planted = tmp_path / f"spark_torch_traces-{os.getuid()}"
    planted.mkdir(mode=0o700)
    os.chown(planted, 4242, 4242)
    with caplog.at_level(logging.WARNING, logger="spark_torch"):
        where = trace_dir(None, "run", 0)
    refused = [r.getMessage() for r in caplog.records if "refused the folder" in r.getMessage()]
    assert len(refused) == 1 and str(planted) in refused[0] and "owner uid 4242" in refused[0], refused
    assert where is not None and where.path == str(runtime / "spark_torch_traces" / "run" / "attempt-0")
    assert _store(tmp_path, where, caplog) == []
    assert list(planted.iterdir()) == []


def test_a_stall_watch_never_raises_on_a_trace(tmp_path: Path) -> None:
    watch = StallWatch(2, 0, trace_dir=TraceDir(str(tmp_path), ("t",)))
    for rank, data in ((0, b'{"entries": 5}'), (None, b"x"), (7, b"x"), (1, b"[" * 100_000)):
        watch.trace(rank, data)
    watch.close()


@pytest.fixture
def slow_writes(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Every trace write blocks until released (or a deadline: then ``timed_out`` is set)."""
    entered, released, timed_out = threading.Event(), threading.Event(), threading.Event()
    write = flight_recorder._write_trace

    def slow(folder: int, rank: int, data: bytes) -> None:
        entered.set()
        if not released.wait(RANKS_SECONDS):
            timed_out.set()
        write(folder, rank, data)

    monkeypatch.setattr(flight_recorder, "_write_trace", slow)
    yield entered, timed_out
    released.set()


def test_lines_keep_arriving_while_a_trace_is_written_slowly(
    spark_session: Any, slow_writes: Any, tmp_path: Path, no_leftovers: None
) -> None:
    entered, timed_out = slow_writes
    result = Distributor(
        num_processes=2, local_mode=False, spark=spark_session, stall_timeout=2, log_dir=str(tmp_path), log_ranks=[]
    ).run(stuck_then_talks, 20)
    assert result == 3
    assert entered.is_set(), "no trace was written: did the stall go unnoticed?"
    assert not timed_out.is_set(), "the run ended only once the slow write gave up: it held the channel"
    assert "rank 1 talks after the stall" in (tmp_path / "rank-1.log").read_text()
    assert (tmp_path / "flight-recorder" / "attempt-0").is_dir()  # the first attempt's number


def test_a_rank_without_collectives_yet() -> None:
    dump = read_dump(b'{"version": "2.10", "pg_config": {}}')  # torch leaves "entries" out
    assert summary({0: dump}) == ["rank 0: no collective in flight"]


def test_a_started_nccl_collective() -> None:
    dump = read_dump(
        b'{"entries": [{"profiling_name": "nccl:all_reduce", "collective_seq_id": 7, "state": "started",'
        b' "retired": false, "input_sizes": [[4, 4]]}]}'
    )
    assert rank_line(dump) == "nccl:all_reduce #7 in flight (started), sizes [4, 4]"


def test_a_resumed_runs_trace_folders_number_on_as_its_attempts(tmp_path: Path, no_leftovers: None) -> None:
    """Two run() calls with one run_id: the second call's traces go to attempt-1, the number its
    own AttemptRecord has (the first call's attempt-0 is kept, not overwritten)."""
    from tests.stall_programs import one_rank_stuck

    logs = tmp_path / "logs"
    for call in range(2):
        d = Distributor(
            num_processes=2,
            run_id="traces-number-on",
            storage_path=str(tmp_path / "runs"),
            log_dir=str(logs),
            stall_timeout=2,
            log_ranks=[],
        )
        assert d.run(one_rank_stuck, 8) == 3
        assert d.last_run is not None and [a.attempt for a in d.last_run.attempts] == [call]
        folder = logs / "flight-recorder" / f"attempt-{call}"
        assert folder.is_dir() and sorted(p.name for p in folder.iterdir()) == ["rank_0.json", "rank_1.json"], call
    assert (logs / "flight-recorder" / "attempt-0" / "rank_0.json").exists()


def test_the_error_names_the_dump_the_nccl_watchdog_left(tmp_path: Path, no_leftovers: None) -> None:
    _dies_the_watchdogs_way(tmp_path, {})


def test_the_error_names_the_dump_the_nccl_watchdog_left_distributed(
    spark_session: Any, tmp_path: Path, no_leftovers: None
) -> None:
    # the session as an argument, not request.getfixturevalue: conftest orders tests by the
    # session fixtures they name (one obtained otherwise started a JVM among the no-Spark tests)
    _dies_the_watchdogs_way(tmp_path, {"local_mode": False, "spark": spark_session})


def _dies_the_watchdogs_way(tmp_path: Path, spark: dict[str, Any]) -> None:
    """A rank that dies as torch's NCCL watchdog makes it on a timeout (its dump written to
    TORCH_FR_DUMP_TEMP_FILE + rank, then SIGABRT; the real thing needs a GPU: gpu_check's
    e_nccl_fr): the error leads with that rank and names the dump, its host and how to read it;
    an older dump of another rank at the same prefix is not named."""
    from tests.fr_programs import dies_like_the_nccl_watchdog

    logs = tmp_path / "logs"
    logs.mkdir()
    prefix = logs / "nccl_trace_rank_"
    stale = Path(f"{prefix}0")
    stale.write_bytes(b"an earlier run's dump")
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    started = time.monotonic()
    with pytest.raises(DistributedRunError) as caught:
        Distributor(num_processes=2, env={"TORCH_FR_DUMP_TEMP_FILE": str(prefix)}, log_ranks=[], **spark).run(
            dies_like_the_nccl_watchdog, 1
        )
    assert time.monotonic() - started < 60, "the other rank was not stopped when this one died"
    message = str(caught.value)
    assert re.match(r"rank 1 on \S+ failed: killed by SIGABRT", message.splitlines()[0]), message
    assert f"(its Flight Recorder) is on {caught.value.failures[0].host}: {prefix}1" in message
    assert f"torchfrtrace {logs} --prefix nccl_trace_rank_ --allow-incomplete-ranks" in message
    assert str(stale) not in message
    assert caught.value.failures[0].dumps == (f"{prefix}1",)


def test_a_rank_that_hangs_after_its_dump_is_named_with_it(tmp_path: Path, no_leftovers: None) -> None:
    _hangs_after_its_dump(tmp_path, {})


class _TimeUpOnceDumped(threading.Event):
    """A barrier stage's wake event whose wait for the attempt's time ends, as a timeout does
    (False), once rank 1's dump exists (at load 20 a rank could start after the 8 s had passed:
    the timeout then fired before anything was dumped); set by the job's end as usual."""

    def __init__(self, dump: Path) -> None:
        super().__init__()
        self.dump = dump

    def wait(self, timeout: float | None = None) -> bool:
        deadline = time.monotonic() + 120
        while not super().wait(0.1):
            if self.dump.exists():
                return False  # the attempt's time is up
            assert time.monotonic() < deadline, f"rank 1 wrote no dump ({self.dump}) within 120 s"
        return True


def test_a_rank_that_hangs_after_its_dump_is_named_with_it_distributed(
    spark_session: Any, tmp_path: Path, no_leftovers: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from spark_torch.driver.run import barrier

    init = barrier._BarrierStage.__init__

    def with_forced_clock(stage: Any, *args: Any, **kwargs: Any) -> None:
        init(stage, *args, **kwargs)
        stage.wake = _TimeUpOnceDumped(tmp_path / "nccl_trace_rank_1")

    monkeypatch.setattr(barrier._BarrierStage, "__init__", with_forced_clock)
    _hangs_after_its_dump(tmp_path, {"local_mode": False, "spark": spark_session})


def _hangs_after_its_dump(tmp_path: Path, spark: dict[str, Any]) -> None:
    """torch's watchdog dumped the rank but the process did not end (seen on a GPU: a kernel still
    running); the run's timeout stops it, and the error names the dump among the stopped ranks."""
    from spark_torch import RunTimeoutError
    from tests.fr_programs import dies_like_the_nccl_watchdog

    prefix = tmp_path / "nccl_trace_rank_"
    env = {"TORCH_FR_DUMP_TEMP_FILE": str(prefix)}
    with pytest.raises(RunTimeoutError) as caught:
        Distributor(num_processes=2, env=env, log_ranks=[], timeout=8, **spark).run(
            dies_like_the_nccl_watchdog, 1, True
        )
    message = str(caught.value)
    assert [s.rank for s in caught.value.stopped] == [0, 1], message
    assert caught.value.stopped[1].dumps == (f"{prefix}1",) and caught.value.stopped[0].dumps == ()
    assert "dump of rank 1 (its Flight Recorder) is on " in message and f": {prefix}1\n" in message
    assert f"torchfrtrace {tmp_path} --prefix nccl_trace_rank_ --allow-incomplete-ranks" in message
