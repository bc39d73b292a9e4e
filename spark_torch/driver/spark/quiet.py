"""Spark's own console output while spark_torch's Spark jobs run.

A failed barrier task makes the driver JVM log a Java trace (with the whole Python traceback
and the node's failure report) once per failed or killed task: ``ERROR Executor`` (local
masters, whose executor is the driver), ``WARN TaskSetManager: Lost task``, and on other
failures the scheduler's and the Python runners' lines. spark_torch already turns the failure
into one readable error, so while a run (or a probe, or ``spark-torch doctor``) has Spark jobs
active, :func:`quiet_spark_logs` sets those loggers to ``OFF`` through the driver's log4j2 (over
the Py4J gateway) and puts back exactly what was there afterwards, whatever level the user's
session has. Spark's console progress bar (``[Stage 3:>  (0 + 2) / 2]``, drawn over whatever
the ranks print, and left half-erased above the error when a stage fails) is set aside the same
way, by the SparkContext's own field (no public switch exists once the context runs), and a new
one is put back afterwards. Runs in several threads share one quiet period (the last one out
restores). Every Py4J call of a quiet period in the caller's thread (the snapshot, the silencing,
the count of running tasks at its end, the restore) runs with Ctrl-C held back, and the wait for
running tasks happens in a thread of its own; the saved levels are dropped only once they are
back, so an interrupt at any moment cannot leave Spark's loggers off, nor make the next run save
OFF as the level to restore (tests/scripts/quiet_interrupts.py sends one during each call).

The loggers are the driver JVM's, for every job: while a run is quiet, a Spark job of your own
that fails in another thread of the same driver prints no ``ERROR Executor`` or ``Lost task``
lines either (its exception still reaches your code); set ``spark_logs`` to keep them.

A killed task is reported a moment after its job failed, so the levels come back once no task
is running any more (at most :data:`RESTORE_WAIT_SECONDS` later, in a daemon thread when it is
not at once). The ``spark_logs`` setting (``SPARK_TORCH_SPARK_LOGS=1``) leaves Spark's logging
alone. Executors on other JVMs (a cluster, ``local-cluster``) log to their own stderr (the
worker's log files), never to the driver's console: nothing changes there.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from spark_torch.driver.spark.cluster import is_connect_session

__all__ = ["quiet_spark_logs", "NOISY_LOGGERS", "RESTORE_WAIT_SECONDS", "wait_restored"]

logger = logging.getLogger(__name__)

#: the driver JVM's loggers that print a Java trace for a failed or killed task (found by
#: running failing runs on local[2] and local-cluster with each logger's name printed)
NOISY_LOGGERS = (
    "org.apache.spark.executor.Executor",
    "org.apache.spark.scheduler.TaskSetManager",
    "org.apache.spark.scheduler.TaskSchedulerImpl",
    "org.apache.spark.scheduler.DAGScheduler",
    "org.apache.spark.scheduler.TaskResultGetter",
    "org.apache.spark.api.python",
    "org.apache.spark.sql.execution.python",
    "org.apache.spark.BarrierTaskContext",
    "org.apache.spark.BarrierCoordinator",
)
#: after the last quiet block, how long the levels stay off while tasks are still running
RESTORE_WAIT_SECONDS = 30.0
_POLL_SECONDS = 0.1

_lock = threading.Lock()
_holders = 0
#: what was there before: (session, log4j context, {logger name: its level or None}, a progress bar)
_saved: tuple[Any, Any, dict[str, Any], bool] | None = None
_restored = threading.Event()
_restored.set()


def _log4j(spark: Any) -> Any | None:
    """The driver's ``org.apache.logging.log4j`` package over Py4J, or None (Connect, no session)."""
    if spark is None or is_connect_session(spark):
        return None
    return spark.sparkContext._jvm.org.apache.logging.log4j


def _progress_field(spark: Any) -> Any | None:
    """The SparkContext's ``_progressBar`` field (made accessible), or None."""
    jsc = spark.sparkContext._jsc.sc()
    for field in jsc.getClass().getDeclaredFields():
        if field.getName().endswith("_progressBar"):
            field.setAccessible(True)
            return field
    return None


def _hide_progress_bar(spark: Any) -> bool:
    """Stop the console progress bar; True when there was one (see :func:`_show_progress_bar`)."""
    try:
        field = _progress_field(spark)
        jsc = spark.sparkContext._jsc.sc()
        if field is None:
            return False
        bar = field.get(jsc)
        if not bar.isDefined():
            return False
        bar.get().finishAll()  # erases what it drew
        bar.get().stop()
        field.set(jsc, spark.sparkContext._jvm.scala.Option.empty())
        return True
    except Exception as exc:  # noqa: BLE001 - another Spark: the bar stays
        logger.debug("spark_torch: could not set Spark's progress bar aside: %s", exc)
        return False


def _show_progress_bar(spark: Any) -> None:
    jvm, jsc = spark.sparkContext._jvm, spark.sparkContext._jsc.sc()
    field = _progress_field(spark)
    if field is not None:
        field.set(jsc, jvm.scala.Option.apply(jvm.org.apache.spark.ui.ConsoleProgressBar(jsc)))


def _snapshot(log4j: Any) -> tuple[Any, dict[str, Any]]:
    """The log4j context and the level each noisy logger has configured now (None: not configured)."""
    context = log4j.LogManager.getContext(False)
    configured = context.getConfiguration().getLoggers()
    saved = {}
    for name in NOISY_LOGGERS:
        existing = configured.get(name)
        saved[name] = existing.getLevel() if existing is not None else None
    return context, saved


def _silence(spark: Any, log4j: Any) -> bool:
    """Every noisy logger OFF, the progress bar set aside (True when there was one)."""
    for name in NOISY_LOGGERS:
        log4j.core.config.Configurator.setLevel(name, log4j.Level.OFF)
    return _hide_progress_bar(spark)


def _restore(spark: Any, context: Any, saved: dict[str, Any], progress_bar: bool) -> None:
    """The saved levels back first (what a user misses most), then the progress bar: a bar that
    cannot be made again never leaves the loggers off."""
    config = context.getConfiguration()
    for name, level in saved.items():
        if level is None:
            config.removeLogger(name)
        else:
            config.getLoggerConfig(name).setLevel(level)
    context.updateLoggers()
    if progress_bar:
        try:
            _show_progress_bar(spark)
        except Exception as exc:  # noqa: BLE001 - a stopped session: its bar went with it
            logger.debug("spark_torch: could not put Spark's progress bar back: %s", exc)


@contextmanager
def _interrupts_held() -> Iterator[None]:
    """Hold Ctrl-C (SIGINT) back until the block is done, then hand it to the handler that was
    there (Python's, or PySpark's, which cancels the jobs and raises KeyboardInterrupt). Only in
    the main thread and under a Python handler; otherwise the block runs as is."""
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or not callable(previous):
        yield
        return
    handler: Callable[[int, Any], Any] = previous
    received: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, _frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, handler)
    if received:
        handler(signal.SIGINT, None)


def _running_tasks(spark: Any) -> int:
    infos = spark.sparkContext._jsc.sc().statusTracker().getExecutorInfos()
    return sum(int(info.numRunningTasks()) for info in infos)


def _restore_when_idle(spark: Any, deadline: float) -> None:
    """Put the levels back once no task runs (or at ``deadline``) unless a new run came in. Runs
    in its own thread (never the main one, where a Ctrl-C would end the wait and the restore)."""
    try:
        while time.monotonic() < deadline and _running_tasks(spark) > 0:
            if _holders > 0:
                return  # a new quiet period took over; it restores when it ends
            _restored.wait(_POLL_SECONDS)
    except Exception as exc:  # noqa: BLE001 - a stopped session: restore what can be restored
        logger.debug("spark_torch: could not count the running tasks: %s", exc)
    with _lock:
        if _holders > 0 or _saved is None:
            return
        _restore_saved()


def _restore_saved() -> None:
    """Put back what :data:`_saved` holds (with ``_lock`` held), Ctrl-C held back meanwhile;
    the snapshot is cleared only once it is restored: an interrupt that still lands here (a
    thread without Python's default handler) leaves it for the next quiet period to restore."""
    global _saved
    assert _saved is not None
    with _interrupts_held():  # a Ctrl-C held back is raised once the snapshot is cleared
        try:
            _restore(*_saved)
        except Exception as exc:  # noqa: BLE001 - never fail a run over logging
            _report_failed_restore(exc)
        _saved = None
        _restored.set()


def _report_failed_restore(exc: Exception) -> None:
    """A restore that failed: quietly when the driver JVM is gone (its loggers went with it), else
    a warning, since Spark's task-failure loggers may be left OFF in a JVM that goes on."""
    if type(exc).__name__ == "Py4JNetworkError":  # the gateway is closed: nothing is left off
        logger.debug("spark_torch: could not restore Spark's log levels: %s", exc)
        return
    logger.warning(
        "spark_torch: could not put back the levels of Spark's task-failure loggers (%s): they may "
        "stay OFF in this driver; set them again with "
        "org.apache.logging.log4j.core.config.Configurator.setLevel (names: %s)",
        exc,
        ", ".join(NOISY_LOGGERS),
    )


def wait_restored(timeout: float) -> bool:
    """Wait until Spark's log levels are back (True), or ``timeout`` seconds passed (False)."""
    return _restored.wait(timeout)


def _same_jvm(one: Any, other: Any) -> bool:
    """Whether two sessions talk to the same driver JVM (the same Py4J gateway)."""
    try:
        return one.sparkContext._gateway is other.sparkContext._gateway
    except Exception:  # noqa: BLE001 - a session that cannot say: not the same
        return False


def _enter(spark: Any, log4j: Any) -> bool:
    """Join the quiet period (the first one in takes the snapshot, then silences): the levels
    are saved before any is changed, so whatever interrupts the change, what was there is known
    and put back. A snapshot an interrupted or pending restore left is kept while the JVM is the
    same, whichever session this run has (log4j's levels are the JVM's: a session stopped and made
    again meanwhile shares them): it holds the user's levels, the current ones are ours."""
    global _holders, _saved
    with _lock:
        if _holders == 0:
            if _saved is not None and _saved[0] is not spark and _same_jvm(_saved[0], spark):
                _saved = (spark, _saved[1], _saved[2], False)  # the new session's progress bar is its own
            if _saved is None or _saved[0] is not spark:
                try:
                    _saved = (spark, *_snapshot(log4j), False)
                except Exception as exc:  # noqa: BLE001 - another logging backend: Spark prints as it likes
                    logger.debug("spark_torch: could not quiet Spark's task-failure logs: %s", exc)
                    return False
            _restored.clear()
            try:
                bar = _silence(spark, log4j)
            except BaseException as exc:
                _restore_saved()  # what was changed goes back before this propagates
                if not isinstance(exc, Exception):
                    raise
                logger.debug("spark_torch: could not quiet Spark's task-failure logs: %s", exc)
                return False
            _saved = (*_saved[:3], _saved[3] or bar)
        _holders += 1
        return True


def _leave(spark: Any) -> None:
    """Leave the quiet period; the last one out restores at once when no task runs, else starts
    the restorer thread. All of it with Ctrl-C held back (a few Py4J calls; the wait for running
    tasks happens in the thread, where no KeyboardInterrupt can land): an interrupt during any of
    these calls cannot leave the levels off, and reaches the user once they are back."""
    global _holders
    with _interrupts_held():
        with _lock:
            _holders -= 1
            if _holders > 0:
                return
        deadline = time.monotonic() + RESTORE_WAIT_SECONDS
        try:
            idle = _running_tasks(spark) == 0
        except Exception:  # noqa: BLE001 - a stopped session: restore now
            idle = True
        if idle:
            with _lock:
                if _holders == 0 and _saved is not None:
                    _restore_saved()
        else:
            threading.Thread(
                target=_restore_when_idle, args=(spark, deadline), name="spark_torch-restore-spark-logs", daemon=True
            ).start()


@contextmanager
def quiet_spark_logs(spark: Any, keep: bool = False) -> Iterator[None]:
    """Inside the block, the driver JVM's task-failure loggers (:data:`NOISY_LOGGERS`) print
    nothing; afterwards their levels are what they were. Nothing changes with ``keep`` (the
    ``spark_logs`` setting), without a classic session, or with a logging backend other than
    log4j2."""
    log4j = None if keep else _log4j(spark)
    if log4j is None:
        yield
        return
    entered = False
    try:
        with _interrupts_held():  # Ctrl-C waits until the levels are saved and changed
            entered = _enter(spark, log4j)
        yield
    finally:
        if entered:
            _leave(spark)
