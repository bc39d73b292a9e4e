"""The spark-torch command, end to end as a subprocess."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .conftest import SCRIPTS, rank_processes, run_temp_dirs

CLI = [sys.executable, "-m", "spark_torch"]


def cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=sys.executable)
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, env=env)


def test_version_and_help() -> None:
    assert cli("--version").stdout.strip().startswith("spark-torch 0.")
    help_text = cli("run", "--help").stdout
    assert "spark-torch run --num-processes 2 train.py" in help_text and "--max-restarts" in help_text


def test_run_local_passes_script_args_untouched(tmp_path: Path) -> None:
    done = cli("run", "-n", "2", str(SCRIPTS / "env_dump.py"), str(tmp_path), "--num-processes", "5", "--local")
    assert done.returncode == 0, done.stderr
    info = json.loads((tmp_path / "rank-1.json").read_text())
    assert info["argv"] == ["--num-processes", "5", "--local"] and info["WORLD_SIZE"] == "2"
    assert "[rank 1] env written by rank 1" in done.stdout


def test_failing_rank_exit_code_and_paragraph() -> None:
    done = cli("run", "-n", "2", str(SCRIPTS / "exit_code.py"), "7", "1")
    assert done.returncode == 7
    assert done.stderr.splitlines()[-1].startswith("  ") or "spark-torch: error: rank 1 on" in done.stderr
    assert "spark-torch: error: rank 1 on" in done.stderr and "exited with code 7" in done.stderr
    assert "Traceback" not in done.stderr.split("spark-torch: error:")[0]


def test_bad_input_exit_2() -> None:
    done = cli("run", "-n", "0", str(SCRIPTS / "env_dump.py"))
    assert done.returncode == 2 and "num_processes must be >= 1" in done.stderr
    missing = cli("run", "does/not/exist.py")
    assert missing.returncode == 2 and "training script not found" in missing.stderr
    assert cli("run", "--env", "NOEQUALS", "x.py").returncode == 2


def _interrupt_after_first_line(args: list[str], lines: int = 1) -> tuple[int, float]:
    """Start the CLI, wait until ``lines`` lines said "hanging", send SIGINT; (exit code, seconds to exit)."""
    env = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=sys.executable)
    # a shell starts background jobs with SIGINT ignored, and an ignored SIGINT is inherited;
    # the CLI must get Ctrl-C the way it does in a terminal
    proc = subprocess.Popen(
        [*CLI, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # noqa: PLW1509
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + 180
    seen = 0
    for line in proc.stdout:
        seen += "hanging" in line
        if seen >= lines or time.monotonic() > deadline:
            break
    start = time.monotonic()
    proc.send_signal(signal.SIGINT)
    try:
        code = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGUSR1)  # the CLI dumps every thread's stack (faulthandler)
        time.sleep(1)
        proc.kill()
        rest = proc.stdout.read()
        for rank in rank_processes():  # do not let one hang fail every later test
            rank.kill()
        pytest.fail(f"spark-torch run did not exit within 60 s of Ctrl-C; its last output:\n{rest[-8000:]}")
    return code, time.monotonic() - start


@pytest.mark.parametrize(
    "mode",
    [["--local"], ["--distributed", "--master", "local[2]", "--conf", "spark.driver.host=127.0.0.1"]],
    ids=["local", "distributed"],
)
def test_ctrl_c_stops_every_rank(mode: list[str], tmp_path: Path) -> None:
    before = set(run_temp_dirs())
    code, took = _interrupt_after_first_line(
        ["run", "-n", "2", *mode, "--storage-path", str(tmp_path), str(SCRIPTS / "hang.py"), "--x", "1"]
    )
    assert code == 130
    assert took < 15
    listed = cli("runs", str(tmp_path)).stdout.splitlines()  # the run is kept, "stopped by Ctrl-C"
    assert len(listed) == 2 and " stopped by Ctrl-C " in listed[1]
    shown = cli("runs", "show", listed[1].split()[0], "--storage", str(tmp_path)).stdout
    assert (
        f"  entry            {SCRIPTS / 'hang.py'} --x 1\n" in shown
        and "  outcome          stopped by Ctrl-C\n" in shown
    )
    deadline = time.monotonic() + 10
    while (rank_processes() or set(run_temp_dirs()) - before) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not rank_processes() and not set(run_temp_dirs()) - before


def test_ctrl_c_prints_where_each_rank_was_once() -> None:
    """The CLI's Ctrl-C shows the stacks the run attached to the interrupt (as the API's
    traceback does), each note once."""
    from spark_torch.cli.main import _interrupted

    interrupt = KeyboardInterrupt()
    assert _interrupted(interrupt) == "spark-torch: interrupted; every rank was stopped"
    note = "spark_torch: where each rank was when the run was interrupted:\n  ranks 0-1:\n    time.sleep(600)"
    interrupt.add_note(note)
    interrupt.add_note(note)
    assert _interrupted(interrupt) == f"spark-torch: interrupted; every rank was stopped\n{note}"


def test_doctor_local() -> None:
    done = cli("doctor", "--master", "local[2]", "--conf", "spark.driver.host=127.0.0.1")
    assert done.returncode == 0, done.stdout + done.stderr
    assert (
        "executor torch" in done.stdout and "executor java" in done.stdout and "2-rank gloo all_reduce" in done.stdout
    )
    assert "0 failed" in done.stdout


def test_tls_cluster_refused() -> None:
    """A cluster that requires TLS (spark.ssl.enabled) is refused, as TorchDistributor refuses it
    (torch traffic is not encrypted), with the key to override."""
    done = cli(
        "run",
        "--distributed",
        "--master",
        "local[1]",
        "--conf",
        "spark.driver.host=127.0.0.1",
        "--conf",
        "spark.ssl.enabled=true",
        "--conf",
        "spark.ui.enabled=false",
        "-n",
        "1",
        str(SCRIPTS / "exit_code.py"),
        "0",
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "requires encryption (spark.ssl.enabled)" in done.stderr and "not encrypted" in done.stderr
    assert "pytorch.spark.distributor.ignoreSsl=true" in done.stderr


def test_rpc_encryption_runs_and_says_what_is_not_encrypted() -> None:
    """spark.network.crypto.enabled alone (Spark's RPC encryption): the run goes on, as with
    TorchDistributor (spark_torch's channel is encrypted itself), with one line saying that
    gloo/NCCL traffic is not; the Spark secret never reaches the output."""
    done = cli(
        "run",
        "--distributed",
        "--master",
        "local[1]",
        "--conf",
        "spark.driver.host=127.0.0.1",
        "--conf",
        "spark.authenticate=true",
        "--conf",
        "spark.authenticate.secret=test-only-secret",
        "--conf",
        "spark.network.crypto.enabled=true",
        "-n",
        "1",
        str(SCRIPTS / "exit_code.py"),
        "0",
    )
    assert done.returncode == 0, done.stderr[-2000:]
    warnings = [line for line in done.stderr.splitlines() if "NOT encrypted" in line]
    assert len(warnings) == 1 and "gloo/NCCL" in warnings[0] and "spark.network.crypto.enabled" in warnings[0]
    assert "test-only-secret" not in done.stderr + done.stdout


def test_doctor_reports_a_blocking_problem_with_its_fix() -> None:
    done = cli(
        "doctor",
        "--master",
        "local[1]",
        "--conf",
        "spark.driver.host=127.0.0.1",
        "--conf",
        "spark.ssl.enabled=true",
        "--conf",
        "spark.ui.enabled=false",
    )
    assert done.returncode == 1, done.stdout + done.stderr[-2000:]
    assert "FAIL  TLS" in done.stdout and "fix: torch traffic is not encrypted" in done.stdout


@pytest.mark.parametrize(
    "command", [["run", "--distributed", "-n", "1", str(SCRIPTS / "exit_code.py"), "0"], ["doctor"]]
)
def test_wrong_master_is_one_line_in_seconds(command: list[str]) -> None:
    """Nothing listens at the master's address: one line naming the URL and what to check,
    within seconds (Spark itself retries for about a minute and prints a page of frames)."""
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
    url = f"spark://127.0.0.1:{dead.getsockname()[1]}"
    try:
        start = time.monotonic()
        done = cli(command[0], "--master", url, *command[1:])
        took = time.monotonic() - start
    finally:
        dead.close()
    assert done.returncode == 1, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines == [lines[0]] and lines[0].startswith(f"spark-torch: error: no Spark master answers at {url}"), (
        done.stderr[-3000:]
    )
    assert "Connection refused" in lines[0] and "7077 by default" in lines[0]
    assert took < 20, took


def test_master_that_is_not_a_master() -> None:
    """Something accepts TCP at the master's address but is no Spark master: Spark's own
    'All masters are unresponsive' becomes one line."""
    from spark_torch.driver.spark.session import _unresponsive

    error = _unresponsive(RuntimeError("...\nAll masters are unresponsive! Giving up.\n..."), "spark://h:7077")
    assert str(error).startswith("the Spark master at spark://h:7077 accepted a connection but never answered")


def test_master_endpoints() -> None:
    from spark_torch.driver.spark.session import master_endpoints

    assert master_endpoints("spark://a:7077,b:7078") == [("a", 7077), ("b", 7078)]
    assert master_endpoints("spark://a") == [("a", 7077)]
    assert master_endpoints("sc://h:15003/;token=x") == [("h", 15003)] and master_endpoints("sc://h") == [("h", 15002)]
    assert master_endpoints("spark://[::1]:7077") == [("::1", 7077)]
    assert master_endpoints("local[2]") == [] and master_endpoints("yarn") == []


def test_run_with_storage_and_resume(tmp_path: Path) -> None:
    env = dict(os.environ, EPOCHS="2")
    args = ["run", "-n", "2", "--storage-path", str(tmp_path), "--run-id", "cli-run", str(SCRIPTS / "report_script.py")]
    first = subprocess.run([*CLI, *args], capture_output=True, text=True, env=env, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    assert (
        f"spark-torch: run cli-run: 2 report(s), latest checkpoint {tmp_path}/cli-run/checkpoint_000002" in first.stderr
    )
    env["EPOCHS"] = "3"
    again = subprocess.run([*CLI, *args], capture_output=True, text=True, env=env, timeout=300)
    assert (
        again.returncode == 0
        and "1 report(s), latest checkpoint" in again.stderr
        and "checkpoint_000003" in again.stderr
    )


def test_master_without_distributed_runs_distributed_and_says_so(tmp_path: Path) -> None:
    """--master used to be ignored without --distributed (every rank ran on the driver)."""
    done = cli(
        "run",
        "--master",
        "local[2]",
        "--conf",
        "spark.driver.host=127.0.0.1",
        "-n",
        "2",
        str(SCRIPTS / "env_dump.py"),
        str(tmp_path),
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "--master local[2]: running distributed (pass --local to run every rank on this machine)" in done.stderr
    assert json.loads((tmp_path / "rank-1.json").read_text())["NODE_RANK"] == "1"  # a node per rank: barrier tasks


def test_logging_and_storage_flags(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    done = cli(
        "run",
        "-n",
        "2",
        "--log-ranks",
        "0",
        "--log-dir",
        str(logs),
        "--no-progress",
        "--no-mlflow",
        "--storage-options",
        "{}",
        str(SCRIPTS / "env_dump.py"),
        str(tmp_path),
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "[rank 0]" in done.stdout and "[rank 1]" not in done.stdout
    assert "env written by rank 1" in (logs / "rank-1.log").read_text()
    bad = cli("run", "--storage-options", "[1]", str(SCRIPTS / "env_dump.py"), str(tmp_path))
    assert bad.returncode == 2 and "--storage-options must be a JSON object (got a JSON list)" in bad.stderr
    bad = cli("run", "--log-ranks", "first", str(SCRIPTS / "env_dump.py"), str(tmp_path))
    assert bad.returncode == 2 and "--log-ranks takes all, none, or rank numbers like 0,1; got 'first'" in bad.stderr
