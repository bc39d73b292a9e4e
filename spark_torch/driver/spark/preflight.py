"""Before the barrier stage: can the executors' Python run a node?

A SparkSession built from an unactivated venv gives executors the system ``python3``; without
this check the barrier stage dies importing psutil, after pages of Java traces. One tiny
ordinary Spark job (one task per node; a plain Python UDF, so the executors need nothing but
PySpark's own worker) asks which interpreter runs there, its version, and which of the modules
a node needs are missing. The probe never raises on an executor: it returns what it found, and
:func:`check_executors` turns a shortfall into one :class:`~spark_torch.errors.LaunchError`
naming the interpreter, its version, what it lacks and the fix.

PySpark's worker itself refuses a Python whose minor version differs from the driver's (or that
does not start at all) before the probe runs; that failure is recognised and reported the same
way; the scheduler's log lines about it (a Java trace per failed task) are held back by the
caller (:func:`~spark_torch.driver.spark.quiet.quiet_spark_logs`, around a whole run).

A probe costs about 0.2 s on a warm local cluster, so a passing answer is remembered per
SparkContext and executor set (per session under Spark Connect): only the first run, and the
first run after executors change, pays for it.
"""

from __future__ import annotations

import builtins
import functools
import json
import logging
import re
import sys
import threading
import time
import types
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from spark_torch.base.background import BackgroundCall
from spark_torch.driver.spark.cluster import is_connect_session
from spark_torch.driver.spark.pyspark_shims import cancel_tagged_job, tagged_job
from spark_torch.errors import LaunchError

__all__ = ["ExecutorPython", "check_executors", "node_modules", "describe_problem", "PROBE_SECONDS"]

logger = logging.getLogger(__name__)

#: imported by the probe: small, and a broken native build shows only on import
IMPORTED = ("psutil", "cloudpickle", "cryptography.hazmat.primitives.ciphers.aead")
#: only looked up (importing torch takes ~2 s, which every run would pay on a fresh worker)
FOUND = ("pyarrow", "torch")
#: how long the probe's job may wait for executors (none of its tasks running: a cluster still
#: scaling up) before the run goes on without the check...
PROBE_SECONDS = 60.0
#: ...while a job still being planned, or whose tasks run (the executors' Python workers starting:
#: a packed venv unpacking, a loaded machine), is waited for up to this long in all
PROBE_RUNNING_SECONDS = 600.0

_lock = threading.Lock()
#: (SparkContext or session, executor set) keys whose executors passed
_passed: set[str] = set()


@dataclass(frozen=True)
class ExecutorPython:
    """What one probe task found: the interpreter, its version, the host, what is missing."""

    executable: str
    version: str
    host: str
    #: top-level module name -> why (``""`` when it is simply not installed)
    missing: tuple[tuple[str, str], ...] = ()


def node_modules(ship_package: bool, needed: Sequence[str] = ()) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(modules to import, modules to find) on an executor; spark_torch itself unless shipped,
    and the run's ``needed`` ones (looked up: torchft for replica groups)."""
    return IMPORTED + (() if ship_package else ("spark_torch",)), FOUND + tuple(needed)


def _probe(imported: Sequence[str], found: Sequence[str], _row: Any) -> str:
    """Executor side, self-contained (sent by value: the executor may lack spark_torch). Never raises."""
    import importlib
    import importlib.util
    import json
    import socket
    import sys

    missing = {}
    for name in list(imported) + list(found):
        top = name.split(".")[0]
        try:
            if name in found:
                if importlib.util.find_spec(name) is None:
                    missing[top] = ""
            else:
                importlib.import_module(name)
        except ModuleNotFoundError as exc:
            missing[top] = "" if exc.name in (top, name) else f"{type(exc).__name__}: {exc}"
        except BaseException as exc:  # noqa: BLE001 - a broken install is a finding, not a failure
            missing[top] = f"{type(exc).__name__}: {exc}"
    return json.dumps(
        {
            "executable": sys.executable,
            "version": ".".join(map(str, sys.version_info[:3])),
            "host": socket.gethostname(),
            "missing": sorted(missing.items()),
        }
    )


def _portable(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A copy of ``fn`` with only builtins for globals: cloudpickle sends it by value."""
    return types.FunctionType(fn.__code__, {"__builtins__": builtins}, fn.__name__, fn.__defaults__)


def _executor_set(spark: Any) -> str:
    """This SparkContext (or Connect session) and its executors, as one cache key."""
    if is_connect_session(spark):
        return f"connect:{getattr(spark, 'session_id', id(spark))}"
    sc = spark.sparkContext
    if sc.master == "local" or sc.master.startswith("local["):
        return f"{sc.applicationId}:driver"  # one executor, the driver (asking a local scheduler logs a WARN)
    try:
        executors = str(sc._jsc.sc().getExecutorIds().mkString(","))
    except Exception:  # noqa: BLE001 - a Spark without this (internal) call: one answer per context
        executors = "?"
    return f"{sc.applicationId}:{executors}"


def _configured_python(spark: Any) -> str | None:
    """The interpreter the session asks executors to run (PYSPARK_PYTHON when it started)."""
    if is_connect_session(spark):
        return None
    return str(spark.sparkContext.pythonExec)


def _ask(
    spark: Any, tasks: int, imported: Sequence[str], found: Sequence[str]
) -> list[ExecutorPython] | BaseException | None:
    """Run the probe job: the facts, the job's exception, or None if it took too long."""
    from pyspark.sql.functions import udf

    probe = udf(functools.partial(_portable(_probe), tuple(imported), tuple(found)), "string", useArrow=False)
    df = spark.range(0, tasks, 1, tasks).select(probe("id").alias("facts"))
    tag = f"spark_torch-preflight-{uuid.uuid4().hex[:8]}"

    def collect() -> list[Any]:
        with tagged_job(spark, tag):
            return list(df.collect())

    job = BackgroundCall(collect, name=tag).start()
    started = time.monotonic()
    waiting_since: float | None = None  # since when its submitted job has had no task running
    while not job.wait(min(1.0, PROBE_SECONDS)):
        now = time.monotonic()
        waits = _waits_for_executors(spark, tag)
        waiting_since = (waiting_since or now) if waits else None
        if now - started >= PROBE_RUNNING_SECONDS or (
            waiting_since is not None and now - waiting_since >= PROBE_SECONDS
        ):
            cancel_tagged_job(spark, tag)
            job.wait(5.0)
            return None
    if job.error is not None:
        return job.error
    found_rows = [json.loads(row["facts"]) for row in job.value or ()]
    return [
        ExecutorPython(f["executable"], f["version"], f["host"], tuple((m, why) for m, why in f["missing"]))
        for f in found_rows
    ]


def _waits_for_executors(spark: Any, tag: str) -> bool:
    """Whether the job tagged ``tag`` waits for executors: submitted, none of its tasks runs and no
    executor runs any task (classic Spark's status tracker; a Connect session cannot tell: True).
    A stage's active tasks come from Spark's status store, which may learn of a started task only
    at the executor's next heartbeat (up to 10 s later); an executor's running tasks come from the
    scheduler at once, so they are asked too."""
    if is_connect_session(spark):
        return True
    try:
        tracker = spark.sparkContext.statusTracker()
        jobs = [tracker.getJobInfo(job_id) for job_id in tracker.getJobIdsForGroup(tag)]
        if not jobs:
            return False  # not submitted yet: the driver is still planning it
        if any(executor.numRunningTasks > 0 for executor in tracker.getExecutorInfos()):
            return False
        for job in jobs:
            for stage_id in job.stageIds if job is not None else ():
                stage = tracker.getStageInfo(stage_id)
                if stage is not None and stage.numActiveTasks > 0:
                    return False
    except Exception:  # noqa: BLE001 - a tracker that cannot answer: the plain deadline
        return True
    return True


def _fix(need: str, driver_python: str) -> str:
    """The three ways out, for an executor Python that must be ``need``."""
    return (
        f"Point PYSPARK_PYTHON at a Python {need} before the SparkSession starts (this driver runs "
        f"{driver_python}; with spark-submit or `spark-torch --conf`: spark.pyspark.python), install "
        "spark-torch with its dependencies into the executors' Python, or ship a packed venv with the job "
        "(spark.archives=venv.tar.gz#venv and PYSPARK_PYTHON=./venv/bin/python; docs/spark-submit.md)"
    )


def _ignored_setting(spark: Any, configured: str | None) -> str | None:
    """``spark.pyspark.python`` of a classic session whose executors do not run it: a key given
    to ``SparkSession.builder.config`` in this process, which PySpark never reads (only
    spark-submit turns it into PYSPARK_PYTHON)."""
    if configured is None:
        return None
    try:
        value = spark.sparkContext.getConf().get("spark.pyspark.python")
    except Exception:  # noqa: BLE001 - nothing to say then
        return None
    return str(value) if value and value != configured else None


def _started(configured: str | None, ignored: str | None = None) -> str:
    if not configured:
        return ""
    note = f" (PYSPARK_PYTHON was {configured!r} when the SparkContext started"
    if ignored:
        note += (
            f"; the session's spark.pyspark.python={ignored!r} was not used: PySpark reads that key only "
            "through spark-submit, not from SparkSession.builder.config in a running Python. Set "
            f"os.environ['PYSPARK_PYTHON'] = {ignored!r} before the session starts"
        )
    return note + ")"


def describe_problem(
    found: Sequence[ExecutorPython],
    configured: str | None,
    driver_python: str = sys.executable,
    ignored: str | None = None,
    hints: Mapping[str, str] | None = None,
) -> str | None:
    """One line naming each executor interpreter that lacks something, and the fix (``hints``: a
    missing module's own, first); None if all is well."""
    groups: dict[tuple[str, str, tuple[tuple[str, str], ...]], set[str]] = {}
    for facts in found:
        if facts.missing:
            groups.setdefault((facts.executable, facts.version, facts.missing), set()).add(facts.host)
    if not groups:
        return None
    parts = []
    for (executable, version, missing), hosts in sorted(groups.items()):
        names = ", ".join(m if not why else f"{m} ({why[:200]})" for m, why in missing)
        where = ", ".join(sorted(hosts)[:4]) + ("..." if len(hosts) > 4 else "")
        parts.append(f"{executable} (Python {version}, on {where}) cannot import {names}")
    lacking = {m for (_, _, missing) in groups for m, _ in missing}
    own = "".join(f"{hint}. " for module, hint in sorted((hints or {}).items()) if module in lacking)
    return (
        f"the executors' Python cannot run spark_torch: {'; '.join(parts)}{_started(configured, ignored)}. {own}"
        + _fix("that has them", driver_python)
    )


#: PySpark 4.x: "...version: 3.10 than that in driver: 3.11"; 3.5: "...version (3, 10) than that in driver 3.11"
_VERSION_MISMATCH = re.compile(
    r"Python in worker has different version:? \(?(\d+)[.,]\s*(\d+)\)? than that in driver:? (\d+\.\d+)"
)
_CANNOT_RUN = re.compile(r'Cannot run program "([^"]+)"[^:]*: (?:error=\d+, )?([^\n\r]+)')


def describe_failure(
    exc: BaseException, configured: str | None, driver_python: str = sys.executable, ignored: str | None = None
) -> str | None:
    """The probe job failed before the probe ran: one line for the causes known to mean a wrong
    executor Python (another minor version, an interpreter that does not start), else None."""
    text = str(exc)
    mismatch = _VERSION_MISMATCH.search(text)
    if mismatch is not None:
        worker, driver = f"{mismatch.group(1)}.{mismatch.group(2)}", mismatch.group(3)
        return (
            f"the executors run Python {worker} and the driver Python {driver}; PySpark needs the same "
            f"major.minor version on both{_started(configured, ignored)}. " + _fix(f"{driver}", driver_python)
        )
    cannot = _CANNOT_RUN.search(text)
    if cannot is not None:
        return (
            f"the executors cannot start their Python {cannot.group(1)!r}: {cannot.group(2).strip()}"
            f"{_started(configured, ignored)}. " + _fix("that exists on every executor", driver_python)
        )
    return None


def check_executors(spark: Any, nodes: int, ship_package: bool, needed: Mapping[str, str] | None = None) -> None:
    """Raise :class:`LaunchError` (one line) unless the executors' Python can run a node (and has
    the modules ``needed`` names, each with its install hint: torchft for replica groups); cached
    per SparkContext, executor set and needed modules once it passed."""
    needed = dict(needed or {})
    key = _executor_set(spark) + "".join(f"+{name}" for name in sorted(needed))
    with _lock:
        if key in _passed:
            return
    imported, found = node_modules(ship_package, sorted(needed))
    configured = _configured_python(spark)
    ignored = _ignored_setting(spark, configured)
    answer = _ask(spark, max(1, nodes), imported, found)
    if answer is None:
        logger.warning(
            "spark_torch: the check of the executors' Python waited %gs for executors to run it (or %gs in all); "
            "starting the run unchecked",
            PROBE_SECONDS,
            PROBE_RUNNING_SECONDS,
        )
        return
    if isinstance(answer, BaseException):
        if isinstance(answer, KeyboardInterrupt):
            raise answer
        message = describe_failure(answer, configured, ignored=ignored)
        if message is not None:
            raise LaunchError(message) from None
        first = next((line for line in str(answer).splitlines() if line.strip()), type(answer).__name__)
        logger.warning(
            "spark_torch: the check of the executors' Python failed (%s); starting the run unchecked", first[:300]
        )
        return
    message = describe_problem(answer, configured, ignored=ignored, hints=needed)
    if message is not None:
        raise LaunchError(message)
    with _lock:
        _passed.add(key)
