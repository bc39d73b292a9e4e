"""A distributed failure reads like a Python failure: while a run's Spark jobs are active, the
driver JVM's task-failure loggers and the progress bar are quiet, and restored afterwards; the
nodes' encoded failure reports never reach the console. End to end in a newcomer's own script
(its own SparkSession at Spark's default console level, in a subprocess whose whole stdout and
stderr are read), and the quiet period itself in this process."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from spark_torch.base.states import Problem, ProblemKind
from spark_torch.driver.run.classify import AttemptEvidence, classify
from spark_torch.driver.run.failures import SparkJobError, attempt_error
from spark_torch.driver.spark import quiet
from spark_torch.errors import DistributedRunError, LaunchError
from spark_torch.shared.node_outcome import NodeOutcome
from spark_torch.shared.sealed import MARKER, find_sealed, seal

from .conftest import CLUSTER_MASTER, SCRIPTS

REPO = Path(__file__).resolve().parent.parent
SCRIPT = SCRIPTS / "user_session_failure.py"
#: what the JVM prints: a log line, a stack frame, the progress bar, a Spark exception's name
_JVM = re.compile(r"^\d\d/\d\d/\d\d \d\d:\d\d:\d\d [A-Z]+ |^\s+at [\w$.<>/]+\(|\[Stage \d+|org\.apache\.spark|SQLSTATE")
#: the lines Python prints for the run's error (its traceback, the chained rank error, ours)
_PYTHON = re.compile(
    r"^(Traceback \(most recent call last\):|  File |    |ValueError: rank one is broken|"
    r"The above exception was the direct cause|spark_torch\.errors\.DistributedRunError: rank 1 |Traceback from rank 1:|$)"
)


def _without_ui(environ: dict[str, str]) -> None:
    """Turn the driver's web UI off (a Java system property the driver's SparkConf reads): the
    suite's workers start other drivers at the same time, and a second UI on port 4040 prints
    "Service 'SparkUI' could not bind" lines a user running one driver never sees. Not a conf
    dir: no log4j file or Java options change (the embedded session's logging stays Spark's
    default), and the JVM keeps the suite's class-data archive (tests/jvm_archive.py), which
    another conf dir on its class path would cost."""
    environ["SPARK_SUBMIT_OPTS"] = f"{environ.get('SPARK_SUBMIT_OPTS', '')} -Dspark.ui.enabled=false".strip()


def user_script(
    master: str, mode: str, then: dict[str, str] | None = None, **env: str
) -> tuple[list[tuple[list[str], list[str]]], int, float]:
    """([(the console from ``run()`` on, its FACT lines)] per run, the exit status, seconds): every
    line of stdout and stderr, each piece the terminal would draw (split at carriage returns
    too). ``then``: a second run in the same session with these driver variables."""
    environ = dict(os.environ, PYTHONPATH=str(REPO), PYSPARK_PYTHON=sys.executable, **env)
    for name in ("SPARK_TORCH_SPARK_LOGS", "SPARK_CONF_DIR", "PYSPARK_SUBMIT_ARGS"):
        if name not in env:
            environ.pop(name, None)
    _without_ui(environ)
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(SCRIPT), master, mode, *(f"{k}={v}" for k, v in (then or {}).items())],
        env=environ,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=400,
    )
    seconds = time.monotonic() - started
    output = done.stdout
    parts = output.split("=== run() ===")[1:]
    assert len(parts) == 1 + bool(then) and all("=== after ===" in part for part in parts), output[-5000:]
    runs = []
    for part in parts:
        console, after = part.split("=== after ===", 1)
        facts = [line for line in after.splitlines() if line.startswith("FACT")]
        runs.append((console.replace("\r", "\n").splitlines(), facts))
    return runs, done.returncode, seconds


def jvm_lines(console: list[str]) -> list[str]:
    return [line for line in console if _JVM.search(line)]


def assert_restored(facts: list[str]) -> None:
    """The TaskSetManager logger's level and the progress bar are back as the script had them."""
    assert (
        len(facts) == 1 and facts[0].startswith("FACT restored True levels True ") and facts[0].endswith(", True)")
    ), facts


@pytest.mark.slow
def test_a_failing_rank_in_a_users_own_session_shows_only_python_and_spark_logs_gives_the_traces_back() -> None:
    """local[2] (the executor is the driver JVM, which logs 'ERROR Executor' and 'WARN
    TaskSetManager' with the whole trace and report for every failed or killed task): from run()
    on, at most 2 JVM lines, and the output is the rank's traceback and our error, nothing else.
    Then, in the same session (one JVM to start for both runs), the documented switch:
    SPARK_TORCH_SPARK_LOGS=1 leaves Spark's logging alone."""
    runs, status, _ = user_script("local[2]", "fail", then={"SPARK_TORCH_SPARK_LOGS": "1"})
    (console, facts), (traces, traces_facts) = runs
    assert status == 0, console + traces
    assert len(jvm_lines(console)) <= 2, jvm_lines(console)
    assert not any(MARKER in line for line in console), "a failure report reached the console"
    others = [line for line in console if not _PYTHON.match(line) and not _JVM.search(line)]
    assert not others, others
    text = "\n".join(console)
    assert "spark_torch.errors.DistributedRunError: rank 1 on 127.0.0.1 failed: ValueError: rank one is broken" in text
    assert 'raise ValueError("rank one is broken")' in text  # the rank's own traceback
    assert_restored(facts)

    assert any(" WARN TaskSetManager: Lost task" in line for line in traces), traces
    assert len(jvm_lines(traces)) > 20
    assert_restored(traces_facts)


@pytest.mark.slow
def test_a_restart_that_succeeds_prints_no_java_trace() -> None:
    """local-cluster (executors in their own JVMs; the driver logs 'WARN TaskSetManager: Lost
    task' with the trace): the failed first attempt and the restart print no JVM line at all."""
    [(console, facts)], status, _ = user_script(CLUSTER_MASTER, "restart")
    assert status == 0, console
    assert "RESULT 2" in console, console
    assert not jvm_lines(console), jvm_lines(console)
    ours = [line for line in console if line.strip() and line != "RESULT 2"]
    assert all(line.startswith("spark_torch: ") for line in ours), ours
    assert any("restarting the gang (1 of 1)" in line for line in ours), ours
    assert_restored(facts)


def cli_failures(*runs: str) -> dict[str, list[str]]:
    """{variables: every console line} of ``spark-torch run --distributed`` with a rank that
    raises, once per ``K=V,K=V`` string of spark_torch variables (``-``: none), the runs one
    after another in one process (tests/scripts/cli_runs.py: one driver JVM for all)."""
    environ = dict(os.environ, PYTHONPATH=str(REPO), PYSPARK_PYTHON=sys.executable)
    for name in ("SPARK_TORCH_SPARK_LOGS", "SPARK_TORCH_CLI_VERBOSE", "SPARK_CONF_DIR"):
        environ.pop(name, None)
    _without_ui(environ)
    command = ["run", "--distributed", "--master", "local[2]", "-n", "2", str(SCRIPTS / "raises.py")]
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / "cli_runs.py"), *runs, "--", *command],
        env=environ,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=400,
    )
    assert done.returncode == 0, done.stdout[-5000:]
    consoles = {}
    for variables, part in zip(runs, done.stdout.split("=== cli ")[1:]):
        head, console = part.split(" ===\n", 1)
        console, exit_line = console.rsplit("=== exit ", 1)
        assert head == variables and exit_line.startswith("1 ==="), part[-5000:]
        assert "ValueError: script failed on purpose" in console, console[-5000:]
        consoles[variables] = console.replace("\r", "\n").splitlines()
    assert list(consoles) == list(runs), done.stdout[-5000:]
    return consoles


@pytest.mark.slow
def test_the_command_as_docs_cli_md_says() -> None:
    """docs/cli.md: no Java line for a failing rank; SPARK_TORCH_SPARK_LOGS=1 gives the traces
    back at the command's ERROR level ('ERROR Executor', no 'WARN TaskSetManager');
    SPARK_TORCH_CLI_VERBOSE=1 keeps the session's level (the WARN lines too). The three runs
    share one process, the verbose one first, while the session is at its starting level."""
    text = (REPO / "docs" / "cli.md").read_text()
    assert (
        "`SPARK_TORCH_SPARK_LOGS=1`" in text and "log level to `ERROR`" in text and "SPARK_TORCH_CLI_VERBOSE=1" in text
    )
    verbose_env, traces_env, quiet_env = (
        "SPARK_TORCH_SPARK_LOGS=1,SPARK_TORCH_CLI_VERBOSE=1",
        "SPARK_TORCH_SPARK_LOGS=1",
        "-",
    )
    runs = cli_failures(verbose_env, traces_env, quiet_env)
    verbose, traces, quiet_run = runs[verbose_env], runs[traces_env], runs[quiet_env]
    assert any(" WARN TaskSetManager: Lost task" in line for line in verbose), verbose
    # the session started in the first run: its start printed no JVM line before the rank's output
    first_rank_line = next(i for i, line in enumerate(verbose) if line.startswith("[rank "))
    assert not jvm_lines(verbose[:first_rank_line]), verbose[:first_rank_line]
    assert any(" ERROR Executor: Exception in task" in line for line in traces), traces
    assert not any(" WARN " in line for line in traces), traces
    assert not jvm_lines(quiet_run) and not any(MARKER in line for line in quiet_run), jvm_lines(quiet_run)


# --- the quiet period, in this process ---------------------------------------------------------


def _level(spark: Any, name: str) -> str:
    log4j = spark.sparkContext._jvm.org.apache.logging.log4j
    return str(log4j.LogManager.getLogger(name).getLevel().toString())


def _configured(spark: Any, name: str) -> bool:
    log4j = spark.sparkContext._jvm.org.apache.logging.log4j
    return log4j.LogManager.getContext(False).getConfiguration().getLoggers().get(name) is not None


def _state() -> str:
    """The quiet period's state and the threads alive, for an assertion's message."""
    threads = sorted(t.name for t in threading.enumerate())
    return f"holders={quiet._holders} saved={quiet._saved is not None} threads={threads}"


def test_quiet_periods_nest_and_restore_what_was_there(spark_session: Any, caplog: pytest.LogCaptureFixture) -> None:
    """Two runs at once share one quiet period; afterwards a logger the user had set keeps its
    level and one they had not is gone from the configuration again."""
    caplog.set_level(logging.DEBUG, logger=quiet.__name__)
    log4j = spark_session.sparkContext._jvm.org.apache.logging.log4j
    executor, tasks = "org.apache.spark.executor.Executor", "org.apache.spark.scheduler.TaskSetManager"
    # an earlier run's restore still pending would put back its own snapshot over this test's level
    assert quiet.wait_restored(60), "an earlier run's quiet period did not end within 60 s"
    log4j.core.config.Configurator.setLevel(tasks, log4j.Level.INFO)
    assert not _configured(spark_session, executor)
    root = _level(spark_session, executor)
    try:
        with quiet.quiet_spark_logs(spark_session):
            with quiet.quiet_spark_logs(spark_session):
                assert _level(spark_session, tasks) == _level(spark_session, executor) == "OFF"
            assert _level(spark_session, tasks) == "OFF"  # the other run is still going
        assert quiet.wait_restored(30), _state()
        assert _level(spark_session, tasks) == "INFO", f"{_state()}\n{caplog.text}"
        assert not _configured(spark_session, executor) and _level(spark_session, executor) == root
        with quiet.quiet_spark_logs(spark_session, keep=True):  # the spark_logs setting
            assert _level(spark_session, tasks) == "INFO"
    finally:
        log4j.LogManager.getContext(False).getConfiguration().removeLogger(tasks)
        log4j.LogManager.getContext(False).updateLoggers()


def test_a_restore_still_pending_when_another_session_runs_keeps_the_users_levels(spark_session: Any) -> None:
    """A run's quiet period ended while tasks still ran (its restore waits for them, up to 30 s) and
    a run on another session of the same JVM starts meanwhile (a test, or a notebook, that stopped
    its session and made a new one): log4j's levels are the JVM's, so the new run must restore the
    user's, not the silenced ones it found (CI's rehearsal once found the Executor logger left OFF
    in the next test's session)."""
    executor = "org.apache.spark.executor.Executor"
    assert quiet.wait_restored(60), "an earlier run's quiet period did not end within 60 s"
    assert not _configured(spark_session, executor)
    earlier = spark_session.newSession()  # another session object on the same JVM
    log4j = spark_session.sparkContext._jvm.org.apache.logging.log4j
    assert quiet._enter(earlier, log4j)
    with quiet._lock:  # the earlier run left; its restore is pending (tasks still running)
        quiet._holders -= 1
    assert _level(spark_session, executor) == "OFF"
    with quiet.quiet_spark_logs(spark_session):
        assert _level(spark_session, executor) == "OFF"
    assert quiet.wait_restored(30)
    assert not _configured(spark_session, executor), "the user's levels were lost: the silenced ones were restored"


def test_a_progress_bar_that_cannot_come_back_leaves_no_logger_off(
    spark_session: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The levels come back before the progress bar: a bar Spark cannot make again (a session
    stopped meanwhile) costs the bar only, quietly; a restore that fails in a JVM that goes on
    says so, naming the loggers that may stay OFF."""
    executor = "org.apache.spark.executor.Executor"
    assert quiet.wait_restored(60), "an earlier run's quiet period did not end within 60 s"

    def no_bar(spark: Any) -> None:
        raise RuntimeError("the SparkContext was stopped")

    monkeypatch.setattr(quiet, "_hide_progress_bar", lambda spark: True)  # as if there was a bar
    monkeypatch.setattr(quiet, "_show_progress_bar", no_bar)
    with caplog.at_level(logging.DEBUG, logger=quiet.__name__):
        with quiet.quiet_spark_logs(spark_session):
            assert _level(spark_session, executor) == "OFF"
        assert quiet.wait_restored(30)
    assert not _configured(spark_session, executor)
    assert "could not put Spark's progress bar back" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]

    def broken(*args: Any) -> None:
        raise RuntimeError("log4j refused")

    caplog.clear()
    with monkeypatch.context() as patch, caplog.at_level(logging.WARNING, logger=quiet.__name__):
        patch.setattr(quiet, "_restore", broken)
        with quiet.quiet_spark_logs(spark_session):
            pass
        assert quiet.wait_restored(30)
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "log4j refused" in warning and executor in warning and "Configurator.setLevel" in warning
    # put back what the broken restore left OFF
    log4j = spark_session.sparkContext._jvm.org.apache.logging.log4j
    config = log4j.LogManager.getContext(False).getConfiguration()
    for name in quiet.NOISY_LOGGERS:
        config.removeLogger(name)
    log4j.LogManager.getContext(False).updateLoggers()
    assert not _configured(spark_session, executor)


def _interrupting(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """``quiet.NAME`` first sends this process Ctrl-C (SIGINT), then does its work: a Ctrl-C
    that lands inside that step."""
    original = getattr(quiet, name)

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        os.kill(os.getpid(), signal.SIGINT)
        return original(*args, **kwargs)

    monkeypatch.setattr(quiet, name, interrupted)


@pytest.mark.parametrize("window", ["_hide_progress_bar", "_restore"], ids=["while-silencing", "while-restoring"])
def test_ctrl_c_in_either_window_leaves_the_levels_as_they_were(
    window: str, spark_session: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C after the levels went OFF but before the quiet period is set up, or in the middle
    of the restore: the KeyboardInterrupt reaches the user, and the levels are the user's, now
    and after the next quiet period."""
    log4j = spark_session.sparkContext._jvm.org.apache.logging.log4j
    executor, tasks = "org.apache.spark.executor.Executor", "org.apache.spark.scheduler.TaskSetManager"
    assert quiet.wait_restored(60), "an earlier run's quiet period did not end within 60 s"
    log4j.core.config.Configurator.setLevel(tasks, log4j.Level.INFO)
    root = _level(spark_session, executor)
    try:
        with monkeypatch.context() as patch:
            _interrupting(patch, window)
            with pytest.raises(KeyboardInterrupt):
                with quiet.quiet_spark_logs(spark_session):
                    assert _level(spark_session, tasks) == "OFF"
        assert quiet.wait_restored(30)
        assert _level(spark_session, tasks) == "INFO" and _level(spark_session, executor) == root
        assert not _configured(spark_session, executor)
        with quiet.quiet_spark_logs(spark_session):  # the next run saves the user's levels, not OFF
            assert _level(spark_session, tasks) == "OFF"
        assert quiet.wait_restored(30)
        assert _level(spark_session, tasks) == "INFO" and not _configured(spark_session, executor)
    finally:
        log4j.LogManager.getContext(False).getConfiguration().removeLogger(tasks)
        log4j.LogManager.getContext(False).updateLoggers()


def test_a_ctrl_c_during_any_py4j_call_of_a_quiet_period_leaves_every_logger_as_it_was() -> None:
    """A real SIGINT during each Py4J call the main thread makes in one quiet period (before the
    JVM acts and after it answered), in a child process with its own session and PySpark's own
    handler: every silenced logger and the progress bar are as the user had them each time, and
    every Ctrl-C reached the user as KeyboardInterrupt (issue 55: two of 37 calls, at the period's
    end, once left all nine loggers OFF)."""
    environ = dict(os.environ, PYTHONPATH=str(REPO), PYSPARK_PYTHON=sys.executable)
    environ.pop("SPARK_TORCH_SPARK_LOGS", None)
    _without_ui(environ)
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / "quiet_interrupts.py")],
        env=environ,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0 and len(lines) == 1, done.stdout[-5000:]
    summary = json.loads(lines[0])
    assert summary["calls"] >= 20, summary  # the snapshot, silencing, bar, the end's count and restore
    assert summary["trials"] == 2 * summary["calls"]
    assert summary["wrong"] == [], summary["wrong"][:3]
    assert summary["interrupted"] == summary["trials"], "a Ctrl-C was swallowed"


def _spark_text(report: str) -> str:
    """What str() of Spark's exception looks like for a failed barrier task (shortened)."""
    return (
        "An error occurred while calling o123.collectAsArrowToPython.\n"
        ": org.apache.spark.SparkException: Job aborted due to stage failure: Could not recover from a failed barrier ResultStage.\n"
        "org.apache.spark.api.python.PythonException: Traceback (most recent call last):\n"
        '  File "spark_torch/node/task.py", line 226, in run_barrier_task\n'
        f"spark_torch.node.task.NodeFailed: the node could not start its ranks\n{report}\n"
        "\tat org.apache.spark.api.python.BasePythonRunner$ReaderIterator.handlePythonException(PythonRunner.scala:1097)\n"
        "\tat java.base/java.lang.Thread.run(Thread.java:840)\n"
        f"Caused by: TaskKilled (Stage cancelled: {report[:300]}\n"
    )


def _error(spark_error: BaseException, secret: bytes) -> BaseException:
    """The user's error for a barrier job that failed with ``spark_error`` (nothing over the
    channel): the node's end sealed in Spark's text, as the barrier stage gathers it."""
    ends = find_sealed(str(spark_error), secret)
    return attempt_error(classify(AttemptEvidence(nodes=1, outcomes=ends, spark_error=spark_error)))


def test_the_spark_exception_the_user_sees_carries_no_report() -> None:
    """A node's sealed end decides the error; Spark's exception is chained as SparkJobError, its
    text without the sealed ends (whole or cut) and without JVM frames."""
    secret = b"s" * 32
    report = seal(0, NodeOutcome(problem=Problem(ProblemKind.LAUNCH, "the node could not start its ranks")), secret)
    error = _error(RuntimeError(_spark_text(report)), secret)
    assert isinstance(error, LaunchError) and str(error) == "the node could not start its ranks"
    cause = error.__cause__
    assert isinstance(cause, SparkJobError) and "\n" not in str(cause) and "spark_logs" in str(cause), str(cause)
    # no verified report (a lost executor, a report from another run): Spark's text, without
    # the reports and the JVM frames
    for text, kind in [
        ("ExecutorLostFailure (executor 1 exited)\n\tat x.y(Z.java:1)", DistributedRunError),
        (_spark_text(report), LaunchError),
    ]:
        other = _error(RuntimeError(text), b"another run's secret")
        assert isinstance(other, kind) and isinstance(other.__cause__, SparkJobError)
        shown = str(other) + str(other.__cause__)
        assert MARKER not in shown and "\tat " not in shown, shown
    assert "NodeFailed: the node could not start its ranks" in str(other.__cause__)
