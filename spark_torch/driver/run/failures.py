"""How a run's outcome becomes the exception the user sees: one place for both modes.

A node's failure arrives as a :class:`~spark_torch.failure_reports.FailureReport`: built in
process (local mode), or received authenticated over the channel or inside Spark's task
exception (distributed mode). :func:`error_from_report` turns it into the library's error, with
the failing rank's own exception as ``__cause__`` when it could be rebuilt.
:func:`error_from_spark_failure` does the same for a failed barrier job, and names what went
wrong when no node could report (a missing module on the executors, an executor lost, too few
slots, a result over ``spark.driver.maxResultSize``). Spark's own exception reaches the user
only as the ``__cause__`` of that error, as a :class:`SparkJobError`: its Python text without the
nodes' encoded reports and without JVM frames. :func:`timeout_error` is the
:class:`~spark_torch.RunTimeoutError` of both modes.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from spark_torch.driver.spark.slots import RANKS_PER_TASK_FIX
from spark_torch.errors import (
    ConfigurationError,
    DistributedRunError,
    InsufficientSlotsError,
    LaunchError,
    RankFailure,
    RunTimeoutError,
)
from spark_torch.failure_reports import MARKER, FailureReport, decode_report, merge_reports
from spark_torch.rank_files import rebuild_exception

__all__ = ["error_from_report", "error_from_spark_failure", "timeout_error", "SparkJobError", "without_reports"]

#: a node runner that could not even start: an import failed in Spark's Python worker
_MISSING_MODULE = re.compile(r"No module named '([\w.]+)'")
#: a node's encoded report inside Spark's text (also a cut one: Spark shortens some reasons)
_REPORT = re.compile(re.escape(MARKER) + r"<[A-Za-z0-9+/=.]*>?(?:" + re.escape(MARKER) + r")?")
#: a JVM stack frame line, and where PySpark appends the JVM's stack trace
_JVM_FRAME = re.compile(r"^\s+at [\w$.<>/]+\(.*\)\s*$|^\s+\.\.\. \d+ more\s*$")
_JVM_TRACE = "JVM stacktrace:"
#: how much of Spark's text the chained exception keeps
_SPARK_TEXT_LINES = 40


class SparkJobError(RuntimeError):
    """The Spark job's own failure, as the ``__cause__`` of the error a failed run raises: the
    text Spark gave, without the nodes' encoded reports and JVM frames (``spark_logs=True``
    keeps Spark's full traces in its log)."""


def without_reports(text: str) -> str:
    """``text`` with every node's encoded failure report replaced by a short note."""
    return _REPORT.sub("(a spark_torch failure report, decoded by the driver)", text)


def _visible(exc: BaseException) -> SparkJobError:
    text = without_reports(str(exc)).split(_JVM_TRACE, 1)[0]
    lines = [line for line in text.splitlines() if not _JVM_FRAME.match(line)]
    if len(lines) > _SPARK_TEXT_LINES:
        lines = [*lines[:_SPARK_TEXT_LINES], f"... ({len(lines) - _SPARK_TEXT_LINES} more lines)"]
    return SparkJobError(f"{type(exc).__name__}: " + "\n".join(lines).strip())


def error_from_report(report: FailureReport) -> BaseException:
    """The exception for a node's (or several merged nodes') failure report.

    A node that could not start its ranks reports a ``kind``: LaunchError or ConfigurationError
    with the node's message; failed ranks become a :class:`DistributedRunError` that leads with
    the earliest failure, caused by that rank's exception (unpickled only because the report is
    authenticated or was built in this process; else rebuilt from text when it is a builtin).
    """
    failures = list(report.failures)
    if report.kind == "LaunchError":
        return LaunchError(failures[0].exc_message if failures else "the ranks could not be started")
    if report.kind == "ConfigurationError":
        return ConfigurationError(failures[0].exc_message if failures else "invalid input")
    error = DistributedRunError(failures, report.headline)
    if error.failures:
        root = error.failures[0]
        cause = rebuild_exception(root, report.pickled.get(root.rank))
        if cause is not None:
            error.__cause__ = cause
    return error


def error_from_spark_failure(exc: BaseException, secret: bytes, channel_reports: Sequence[FailureReport]) -> BaseException:
    """Turn a failed barrier job into the library's error, from the nodes' authenticated
    reports: those sent over the channel, and the one inside Spark's exception text.

    The exception text also holds whatever the failing rank printed or raised, so only a report
    whose MAC verifies with this run's secret is used (and only then is an exception unpickled).
    """
    text = str(exc)
    from_text = decode_report(text, secret)
    report = merge_reports([*channel_reports, *([from_text] if from_text is not None else [])])
    error = error_from_report(report) if report is not None else _from_spark_text(without_reports(text))
    if error.__cause__ is None and report is not None:  # the report said it all; Spark's text adds Java
        error.__cause__ = SparkJobError(
            "Spark's barrier job ended because this node failed (Spark's own trace: the spark_logs setting)"
        )
    elif error.__cause__ is None:  # the user sees Spark's exception chained: never with a report in it
        error.__cause__ = _visible(exc)
    return error


def _from_spark_text(text: str) -> BaseException:
    """The error for a failed barrier job from which no node reported."""
    missing = _MISSING_MODULE.search(text)
    if missing is not None:
        return LaunchError(
            f"the executors' Python cannot import {missing.group(1)}, which spark_torch needs on every "
            "executor: install spark-torch's dependencies (torch, pyarrow, cloudpickle, psutil, cryptography) "
            "into the executors' Python, or point PYSPARK_PYTHON / spark.pyspark.python at an "
            "interpreter that has them (docs/spark-submit.md)"
        )
    if "requires more slots than the total number of slots" in text:
        return InsufficientSlotsError(
            "the barrier stage needs more task slots than the cluster has free (Spark gave up "
            f"after retrying); use fewer processes, {RANKS_PER_TASK_FIX}, add executors/cores, or lower "
            "spark.task.cpus"
        )
    lost = next((line for line in text.splitlines() if "ExecutorLostFailure" in line), None)
    if lost is not None:
        detail = lost[lost.index("ExecutorLostFailure"):][:500]
        return DistributedRunError(
            [],
            headline=f"a node of the run was lost: {detail}. Every rank was stopped; check the "
            "executor's logs (memory limits, preemption) and retry, or use max_restarts",
        )
    if "maxResultSize" in text:
        return DistributedRunError(
            [],
            headline="rank 0's result is larger than spark.driver.maxResultSize; raise that Spark "
            "setting when creating the session (e.g. 4g) or return a smaller result "
            "(save large objects to a file and return its path)",
        )
    first = next((line for line in text.splitlines() if line.strip()), text)
    return LaunchError(f"the Spark barrier job failed before the ranks reported: {first[:2000]}")


def timeout_error(
    run_timeout: float | None,
    running: Sequence[RankFailure],
    stopped: str,
    stacks: tuple[dict[int, str], str | None] = ({}, None),
) -> RunTimeoutError:
    """The run exceeded ``timeout``: ``running`` are the ranks still running (with their last
    lines), ``stopped`` says what was stopped, ``stacks`` where each rank was just before."""
    return RunTimeoutError(
        list(running), headline=f"the run exceeded timeout={run_timeout:g}s; {stopped}", stacks=stacks[0], stacks_text=stacks[1]
    )
