"""Faults: the driver dies, an executor dies, runs overlap, results are too large."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from spark_torch import DistributedRunError, Distributor, RunTimeoutError

from ..conftest import SCRIPTS, rank_processes, run_temp_dirs, session_executors


def _gone(pids: list[int], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
            return True
        time.sleep(0.1)
    return False


def test_driver_sigkill_takes_ranks_and_grandchildren(tmp_path: Path) -> None:
    """PR_SET_PDEATHSIG kills the ranks; the reaper kills their process groups and temp dir."""
    before = set(run_temp_dirs())
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    driver = subprocess.Popen(
        [sys.executable, str(SCRIPTS / "local_driver.py")], stdout=subprocess.PIPE, text=True, env=env
    )
    assert driver.stdout is not None
    pids: list[int] = []
    for line in driver.stdout:
        match = re.search(r"pid (\d+) grandchild (\d+)", line)
        if match:
            pids += [int(match.group(1)), int(match.group(2))]
        if len(pids) == 4:
            break
    driver.kill()
    driver.wait()
    assert _gone(pids, 10), f"still alive: {[p for p in pids if psutil.pid_exists(p)]}"
    deadline = time.monotonic() + 10
    while set(run_temp_dirs()) - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not set(run_temp_dirs()) - before


def print_many(count: int) -> int:
    for i in range(count):
        print(f"line {i:06d} " + "x" * 40)
    return count


def test_many_lines_all_delivered_in_order(
    spark_session: Any, capsys: pytest.CaptureFixture[str], no_leftovers: None
) -> None:
    count = 20000
    assert Distributor(num_processes=2, local_mode=False, spark=spark_session).run(print_many, count) == count
    out = capsys.readouterr().out
    for rank in (0, 1):
        got = [int(m) for m in re.findall(rf"^\[rank {rank}\] line (\d+) ", out, flags=re.M)]
        assert got == list(range(count))


def long_line() -> int:
    print("y" * 200_000)
    return 0


def test_very_long_line_split_and_marked(capsys: pytest.CaptureFixture[str], no_leftovers: None) -> None:
    Distributor(num_processes=1).run(long_line)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[rank 0] y")]
    assert sum(line.count("y") for line in lines) == 200_000
    assert lines[0].endswith("[line continues]") and not lines[-1].endswith("[line continues]")


def mixed_output() -> int:
    import sys

    sys.stdout.write("crlf line\r\n")
    sys.stdout.write("caf\u00e9 \u2603 " * 30_000 + "\n")  # multi-byte text across pipe reads
    sys.stdout.write("no newline at the end")
    return 0


def test_line_endings_and_utf8_across_reads(capsys: pytest.CaptureFixture[str], no_leftovers: None) -> None:
    Distributor(num_processes=1).run(mixed_output)
    out = capsys.readouterr().out
    assert "[rank 0] crlf line\n" in out
    text = "".join(
        line.removeprefix("[rank 0] ").removesuffix(" [line continues]")
        for line in out.splitlines()
        if "caf" in line or "\u2603" in line
    )
    assert text == "caf\u00e9 \u2603 " * 30_000 and "\ufffd" not in out
    assert out.endswith("[rank 0] no newline at the end\n")


def run_id_after(seconds: float) -> str:
    time.sleep(seconds)
    return os.environ["SPARK_TORCH_RUN_ID"] + ":" + os.environ["MASTER_PORT"]


def test_two_concurrent_runs_are_isolated(
    spark_session: Any, capsys: pytest.CaptureFixture[str], no_leftovers: None
) -> None:
    results: dict[str, Any] = {}

    def go(name: str, local: bool) -> None:
        try:
            results[name] = Distributor(num_processes=1, local_mode=local, spark=spark_session).run(run_id_after, 2.0)
        except BaseException as exc:  # noqa: BLE001
            results[name] = exc

    threads = [threading.Thread(target=go, args=(n, n.startswith("local"))) for n in ("dist-a", "dist-b", "local-c")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    values = [results[n] for n in ("dist-a", "dist-b", "local-c")]
    assert all(isinstance(v, str) for v in values), values
    run_ids = {v.split(":")[0] for v in values}
    ports = {v.split(":")[1] for v in values}
    assert len(run_ids) == 3 and len(ports) == 3


def restart_once(marker: str) -> int:
    restart = int(os.environ["SPARK_TORCH_RESTART_COUNT"])
    if restart == 0 and os.environ["RANK"] == "1":
        raise RuntimeError("first attempt fails")
    return restart


def test_restart_distributed(spark_session: Any, no_leftovers: None) -> None:
    assert (
        Distributor(num_processes=2, local_mode=False, spark=spark_session, max_restarts=1).run(restart_once, "m") == 1
    )


@pytest.mark.slow
def test_executor_loss(cluster_spark: Any, no_leftovers: None) -> None:
    """SIGKILL one executor JVM mid-run: a clear error naming the lost node, nothing left running."""
    errors: list[BaseException] = []

    def go() -> None:
        try:
            Distributor(num_processes=2, local_mode=False, spark=cluster_spark, timeout=180).run(
                str(SCRIPTS / "hang.py")
            )
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    thread = threading.Thread(target=go)
    thread.start()
    deadline = time.monotonic() + 120
    while len(rank_processes()) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    executors = session_executors()
    assert executors, "no executor JVM found"
    start = time.monotonic()
    executors[0].kill()
    thread.join(120)
    assert errors and time.monotonic() - start < 90
    error = errors[0]
    assert isinstance(error, DistributedRunError) and not isinstance(error, RunTimeoutError)
    assert "a node of the run was lost" in str(error) or "ExecutorLost" in str(error), str(error)[:2000]
    from ..conftest import wait_for_slots

    wait_for_slots(cluster_spark, 2)  # Spark replaces the executor for the next tests


def big(megabytes: int) -> bytes:
    return os.urandom(1024) * (megabytes * 1024)


def test_result_from_the_driver_host_skips_max_result_size(cluster_spark: Any, no_leftovers: None) -> None:
    """An executor on the driver's host hands the result over by file: maxResultSize (64m) does not apply."""
    out = Distributor(num_processes=2, local_mode=False, spark=cluster_spark).run(big, 80)
    assert len(out) == 80 * 1024 * 1024


@pytest.mark.slow
def test_result_larger_than_max_result_size(
    cluster_spark: Any, no_leftovers: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a result from another host travels through Spark (on this host it is handed over by file)
    monkeypatch.setenv("SPARK_TORCH_RESULT_TRANSFER", "spark")
    with pytest.raises(DistributedRunError, match=r"larger than spark\.driver\.maxResultSize"):
        Distributor(num_processes=2, local_mode=False, spark=cluster_spark).run(big, 80)
