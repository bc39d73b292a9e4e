"""``spark-torch doctor`` agrees with ``run()``: it ships the package and checks the executors'
Python the way a run does, keeps every row (one that cannot run says why), prints no Java
trace, and exits 0 on a cluster a run can use. End to end: the command in a subprocess on
``local-cluster``, whose executors run a Python that lacks only spark_torch (which the driver
ships) or lacks torch."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
#: one executor JVM of two cores: the 2-rank all_reduce fits, and one executor JVM fewer to start
#: than the suite's CLUSTER_MASTER (each costs CPU-seconds; the executor count is not what is tested)
MASTER = "local-cluster[1,2,1024]"
#: every row doctor prints, in order
ROWS = (
    "driver python / torch / pyspark",
    "driver java / spark",
    "master",
    "free task slots",
    "spark_torch shipped to the executors",
    "executors' Python (run()'s check)",
    "executor hosts probed",
    "executor java",
    "executor python",
    "executor torch",
    "executor pyspark",
    "executor spark_torch",
    "GPUs per executor / per task",
    "TLS (spark.ssl.enabled)",
    "RPC encryption (spark.network.crypto.enabled)",
    "2-rank gloo all_reduce",
)
JAVA_TRACE_MARKS = ("\tat org.apache", "\tat java.", "Lost task", "Exception in task", "Py4J", "SPARK_TORCH_FAILURE")


def doctor(python: str, hide: str) -> tuple[int, dict[str, str], str, float]:
    """(exit status, {row: its line}, the whole output, seconds) of doctor on local-cluster."""
    import subprocess

    env = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1", PYTHONPATH=str(REPO), SPARK_TORCH_TEST_HIDE=hide)
    env.pop("PYSPARK_PYTHON", None)
    started = time.monotonic()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "spark_torch",
            "doctor",
            "--master",
            MASTER,
            "--conf",
            "spark.driver.host=127.0.0.1",
            "--conf",
            "spark.ui.enabled=false",
            "--conf",
            f"spark.pyspark.python={python}",
        ],
        capture_output=True,
        text=True,
        timeout=400,
        env=env,
    )
    output = done.stdout + done.stderr
    rows = {}
    for line in done.stdout.splitlines():
        for name in ROWS:
            if line[6:].startswith(name + " "):
                rows[name] = line
    return done.returncode, rows, output, time.monotonic() - started


def assert_every_row_and_no_trace(rows: dict[str, str], output: str) -> None:
    assert list(rows) == list(ROWS), output
    found = [mark for mark in JAVA_TRACE_MARKS if mark in output]
    assert not found, f"{found} in doctor's output:\n{output[-4000:]}"


def test_executors_without_spark_torch_pass_as_run_does(hiding_python: str) -> None:
    """The executors lack only spark_torch: run() ships it and runs; doctor says so and exits 0."""
    status, rows, output, _ = doctor(hiding_python, "spark_torch")
    assert status == 0, output
    assert_every_row_and_no_trace(rows, output)
    # local-cluster's RPC is not encrypted: the row warns as every run on it does (one table of checks)
    rpc = "RPC encryption (spark.network.crypto.enabled)"
    assert rows[rpc].startswith("warn") and "fix: set spark.authenticate=true" in output, output
    assert all(line.startswith("ok  ") for name, line in rows.items() if name != rpc), output
    assert rows["spark_torch shipped to the executors"].endswith("yes (0.1.0)"), rows
    assert rows["executors' Python (run()'s check)"].endswith("can run spark_torch")
    assert rows["2-rank gloo all_reduce"].endswith("ok (2)")
    assert f"{len(ROWS) - 1} checks passed, 0 failed, 1 with a warning a run would print too" in output


def test_executors_without_torch_fail_with_runs_message(hiding_python: str) -> None:
    """The executors lack torch: the row says what run() says (the interpreter, torch, the fix),
    and the all_reduce row says it did not run and why."""
    status, rows, output, _ = doctor(hiding_python, "torch")
    assert status == 1, output
    assert_every_row_and_no_trace(rows, output)
    check = rows["executors' Python (run()'s check)"]
    assert check.startswith("FAIL") and "the executors' Python cannot run spark_torch: " in check, check
    assert "cannot import torch" in check and hiding_python in check
    assert "fix: Point PYSPARK_PYTHON at a Python that has them" in output
    assert rows["executor torch"].startswith("FAIL") and rows["executor torch"].endswith("missing")
    allreduce = rows["2-rank gloo all_reduce"]
    assert (
        allreduce.startswith("skip")
        and "not run: executors' Python (run()'s check), executor torch failed first" in allreduce
    )
    assert "checks passed, 2 failed, 1 with a warning a run would print too, 1 not run" in output
    docs = (REPO / "docs" / "cli.md").read_text()  # what docs/cli.md says doctor does, shown above
    assert "the same message and fix as a run" in docs and "is marked `skip` and says why" in docs
    assert "exits 0 when a run would work" in docs
