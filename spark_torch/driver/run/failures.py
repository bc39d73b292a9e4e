"""How an attempt's end becomes the exception the user sees: the one place, for both modes.

An attempt ends as an :class:`~spark_torch.driver.run.outcome.AttemptOutcome`; when the policy
says raise, :func:`attempt_error` builds the error from its typed cause. Failed ranks arrive
in their nodes' :class:`~spark_torch.shared.node_outcome.NodeOutcome` (in process in local mode;
sealed with the run's secret in distributed mode): they become a :class:`DistributedRunError`
with the failing rank's own exception as ``__cause__`` when it could be rebuilt. A failed barrier
job from which no node said anything is read by :func:`classify_spark_text` (a missing module on
the executors, an executor lost, too few slots, a result over ``spark.driver.maxResultSize``).
Spark's own exception reaches the user only as the ``__cause__`` of the error, as a
:class:`SparkJobError`: its Python text without the nodes' sealed ends and without JVM frames.
"""

from __future__ import annotations

import re

from spark_torch.base.states import Problem, ProblemKind, StopReason
from spark_torch.driver.run.outcome import (
    AttemptOutcome,
    DriverStop,
    Interrupted,
    RanksFailed,
    RanksStopped,
    SparkFailureKind,
    SparkJobFailed,
    StartProblem,
)
from spark_torch.driver.spark.slots import RANKS_PER_TASK_FIX
from spark_torch.errors import (
    ConfigurationError,
    DistributedRunError,
    InsufficientSlotsError,
    LaunchError,
    RunStalledError,
    RunTimeoutError,
    SparkTorchError,
)
from spark_torch.shared.rank_files import rebuild_exception
from spark_torch.shared.sealed import MARKER

__all__ = [
    "attempt_error",
    "unreadable_result_error",
    "problem_error",
    "classify_spark_text",
    "SparkJobError",
    "without_reports",
]

#: a node runner that could not even start: an import failed in Spark's Python worker
_MISSING_MODULE = re.compile(r"No module named '([\w.]+)'")
#: a node's sealed end inside Spark's text (also a cut one: Spark shortens some reasons)
_REPORT = re.compile(re.escape(MARKER) + r"<[A-Za-z0-9+/=.]*>?(?:" + re.escape(MARKER) + r")?")
#: a JVM stack frame line, and where PySpark appends the JVM's stack trace
_JVM_FRAME = re.compile(r"^\s+at [\w$.<>/]+\(.*\)\s*$|^\s+\.\.\. \d+ more\s*$")
_JVM_TRACE = "JVM stacktrace:"
#: how much of Spark's text the chained exception keeps
_SPARK_TEXT_LINES = 40


class SparkJobError(RuntimeError):
    """The Spark job's own failure, as the ``__cause__`` of the error a failed run raises: the
    text Spark gave, without the nodes' sealed ends and JVM frames (``spark_logs=True``
    keeps Spark's full traces in its log)."""


def without_reports(text: str) -> str:
    """``text`` with every node's sealed end replaced by a short note."""
    return _REPORT.sub("(a spark_torch node's end, read by the driver)", text)


def _visible(exc: BaseException) -> SparkJobError:
    text = without_reports(str(exc)).split(_JVM_TRACE, 1)[0]
    lines = [line for line in text.splitlines() if not _JVM_FRAME.match(line)]
    if len(lines) > _SPARK_TEXT_LINES:
        lines = [*lines[:_SPARK_TEXT_LINES], f"... ({len(lines) - _SPARK_TEXT_LINES} more lines)"]
    return SparkJobError(f"{type(exc).__name__}: " + "\n".join(lines).strip())


#: the error class of each kind of problem that kept an attempt's ranks from starting
_PROBLEM_ERRORS: dict[ProblemKind, type[SparkTorchError]] = {
    ProblemKind.LAUNCH: LaunchError,
    ProblemKind.CONFIGURATION: ConfigurationError,
    ProblemKind.SLOTS: InsufficientSlotsError,
}


def problem_error(problem: Problem) -> SparkTorchError:
    """The error for a problem that kept an attempt's ranks from starting (a node's or the driver's)."""
    return _PROBLEM_ERRORS[problem.kind](problem.message)


def classify_spark_text(text: str) -> tuple[SparkFailureKind, str]:
    """What a failed barrier job's text says went wrong, and the detail its message needs."""
    missing = _MISSING_MODULE.search(text)
    if missing is not None:
        return SparkFailureKind.MISSING_MODULE, missing.group(1)
    if "requires more slots than the total number of slots" in text:
        return SparkFailureKind.TOO_FEW_SLOTS, ""
    lost = next((line for line in text.splitlines() if "ExecutorLostFailure" in line), None)
    if lost is not None:
        return SparkFailureKind.EXECUTOR_LOST, lost[lost.index("ExecutorLostFailure") :][:500]
    if "maxResultSize" in text:
        return SparkFailureKind.RESULT_TOO_LARGE, ""
    return SparkFailureKind.OTHER, next((line for line in text.splitlines() if line.strip()), text)[:2000]


def _spark_job_error(failed: SparkJobFailed) -> BaseException:
    """The error for a failed barrier job from which no node reported."""
    kind, detail = failed.kind, failed.detail
    if kind is SparkFailureKind.MISSING_MODULE:
        error: BaseException = LaunchError(
            f"the executors' Python cannot import {detail}, which spark_torch needs on every "
            "executor: install spark-torch's dependencies (torch, pyarrow, cloudpickle, psutil, cryptography) "
            "into the executors' Python, or point PYSPARK_PYTHON / spark.pyspark.python at an "
            "interpreter that has them (docs/spark-submit.md)"
        )
    elif kind is SparkFailureKind.TOO_FEW_SLOTS:
        error = InsufficientSlotsError(
            "the barrier stage needs more task slots than the cluster has free (Spark gave up "
            f"after retrying); use fewer processes, {RANKS_PER_TASK_FIX}, add executors/cores, or lower "
            "spark.task.cpus"
        )
    elif kind is SparkFailureKind.EXECUTOR_LOST:
        error = DistributedRunError(
            [],
            headline=f"a node of the run was lost: {detail}. Every rank was stopped; check the "
            "executor's logs (memory limits, preemption) and retry, or use max_restarts",
        )
    elif kind is SparkFailureKind.RESULT_TOO_LARGE:
        error = DistributedRunError(
            [],
            headline="rank 0's result is larger than spark.driver.maxResultSize; raise that Spark "
            "setting when creating the session (e.g. 4g) or return a smaller result "
            "(save large objects to a file and return its path)",
        )
    else:
        error = LaunchError(f"the Spark barrier job failed before the ranks reported: {detail}")
    error.__cause__ = _visible(failed.spark_error)  # the user sees Spark's exception chained, never a report
    return error


def _ranks_failed_error(failed: RanksFailed) -> BaseException:
    """A :class:`DistributedRunError` that leads with the earliest failure, caused by that rank's
    exception (unpickled only because the outcome was authenticated or built in this process;
    else rebuilt from text when it is a builtin)."""
    error = DistributedRunError(list(failed.failures))
    if error.failures:
        root = error.failures[0]
        cause = rebuild_exception(root, failed.pickled.get(root.rank))
        if cause is not None:
            error.__cause__ = cause
    if error.__cause__ is None and failed.spark_error is not None:  # the outcome said it all; Spark's text adds Java
        error.__cause__ = _node_failed()
    return error


def _node_failed() -> SparkJobError:
    return SparkJobError(
        "Spark's barrier job ended because this node failed (Spark's own trace: the spark_logs setting)"
    )


def attempt_error(outcome: AttemptOutcome) -> BaseException:
    """The exception the user gets for an attempt that did not succeed: the one place where an
    attempt's typed end becomes an exception (the controller raises it when the policy says so)."""
    cause = outcome.cause
    if isinstance(cause, RanksFailed):
        return _ranks_failed_error(cause)
    if isinstance(cause, SparkJobFailed):
        return _spark_job_error(cause)
    if isinstance(cause, StartProblem):
        problem = problem_error(cause.problem)
        problem.__cause__ = _node_failed() if cause.spark_error is not None else cause.cause
        return problem
    if isinstance(cause, RanksStopped):
        return RunTimeoutError(
            [],
            headline=f"the run exceeded timeout={cause.run_timeout:g}s; {cause.what}",
            stacks=cause.stacks.by_rank,
            stacks_text=cause.stacks.text,
            stopped=cause.ranks,
        )
    if isinstance(cause, DriverStop):
        kind = RunStalledError if cause.reason is StopReason.STALLED else DistributedRunError
        return kind([], headline=cause.headline, stacks=cause.stacks.by_rank, stacks_text=cause.stacks.text)
    if isinstance(cause, Interrupted):
        return cause.interrupt
    raise AssertionError(f"an attempt that ended {outcome.end} has no error")  # succeeded, or asked to grow


def unreadable_result_error(exc: Exception) -> DistributedRunError:
    """The error of a run whose attempt succeeded but whose rank 0 value does not unpickle on
    the driver (``exc``: why), with what to return instead."""
    return DistributedRunError(
        [],
        headline=f"rank 0 returned a result that cannot be unpickled on the driver "
        f"({type(exc).__name__}: {exc}); return plain data (numbers, lists, dicts, tensors, "
        "state_dict()) or make the classes it uses importable on the driver",
    )
