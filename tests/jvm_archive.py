"""Quicker JVM starts for the suite: a class-data-sharing archive of a Spark driver's classes.

Most of a Spark test's time on 2 cores is JVMs starting: the suite's own sessions, the CLI's,
the notebooks', spark-submit's, the executors of ``local-cluster``. Java (11+) can map the
classes an earlier JVM loaded from an archive (AppCDS: ``-XX:SharedArchiveFile``) instead of
reading and verifying them again from Spark's jars; with C1 only (``-XX:TieredStopAtLevel=1``,
short-lived JVMs end before C2 pays off) a ``local[2]`` session started in 4 s instead of 10 s
here. The archive is made once per environment (``sys.prefix/spark-torch-test-jvm/``, named by
the Java and PySpark versions) by one short ``local[2]`` application run with
``-XX:ArchiveClassesAtExit``. CDS's own log lines are off, so a JVM that cannot use the archive
(another ``SPARK_CONF_DIR`` comes first on its class path, another Java) starts as it would have,
silently: only the saved time is lost, never a console line a test counts.

Nothing here changes what spark_torch does: only how fast the suite's JVMs start.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

#: the options every JVM of the suite gets besides the archive
QUICK_START = "-XX:TieredStopAtLevel=1 -Xlog:cds=off -Xlog:cds+dynamic=off"
#: how long making the archive may take (one Spark application on local-cluster)
MAKE_SECONDS = 240.0

_DUMP_PROGRAM = """
from pyspark.sql import SparkSession
spark = (SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
         .config("spark.driver.host", "127.0.0.1").getOrCreate())
rdd = spark.sparkContext.parallelize(range(2), 2)
assert rdd.barrier().mapPartitions(lambda it: [sum(it)]).collect() == [0, 1]
assert len(spark.range(64).toPandas()) == 64
spark.stop()
"""


def _versions() -> str:
    """The Java and PySpark this environment runs (an archive is only valid for one Java build)."""
    import pyspark

    try:
        java = subprocess.run(["java", "-version"], capture_output=True, text=True, timeout=60).stderr
    except (OSError, subprocess.TimeoutExpired):
        java = "no java"
    return f"{java}\n{pyspark.__version__}\n{os.path.dirname(pyspark.__file__)}"


def archive_path() -> Path:
    """Where this environment's archive is (or will be)."""
    key = hashlib.sha256(_versions().encode()).hexdigest()[:16]
    return Path(sys.prefix) / "spark-torch-test-jvm" / f"spark-{key}.jsa"


def ensure_archive() -> Path | None:
    """This environment's archive, made first if it is not there (one process makes it while the
    others wait on a lock); None when it cannot be made (the JVMs then start the usual way)."""
    path = archive_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.parent / "lock", "w")  # noqa: SIM115 - held until the archive is there
    except OSError:
        return None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():
            return path
        for stale in path.parent.glob("*.partial"):  # of a run that was killed
            stale.unlink(missing_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.partial")
        env = {k: v for k, v in os.environ.items() if k not in ("SPARK_CONF_DIR", "PYSPARK_SUBMIT_ARGS")}
        # the class path's directories must be empty when the archive is written (Spark's conf dir is one)
        env["SPARK_SUBMIT_OPTS"] = f"-XX:ArchiveClassesAtExit={partial} -Xlog:cds=off -Xlog:cds+dynamic=off"
        env["SPARK_LOCAL_IP"] = "127.0.0.1"
        started = time.monotonic()
        proc = subprocess.Popen(
            [sys.executable, "-c", _DUMP_PROGRAM],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            _, errors = proc.communicate(timeout=MAKE_SECONDS)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the JVM too
            _, errors = proc.communicate()
            errors = f"not made within {MAKE_SECONDS:.0f} s"
        if proc.returncode != 0 or not partial.exists():
            partial.unlink(missing_ok=True)
            tail = errors[-2000:]
            print(f"tests/jvm_archive.py: no class-data archive, JVMs start the usual way: {tail}", file=sys.__stderr__)
            return None
        partial.replace(path)
        print(f"tests/jvm_archive.py: made {path} in {time.monotonic() - started:.0f} s", file=sys.__stderr__)
        return path


def java_options(archive: Path | None) -> str:
    """The options of every JVM the suite starts."""
    return f"-XX:SharedArchiveFile={archive} {QUICK_START}" if archive else QUICK_START


def install(environ: os._Environ[str] | dict[str, str] = os.environ) -> str:
    """Give the drivers (``SPARK_SUBMIT_OPTS``: pyspark's own, the CLI's, spark-submit's,
    notebooks') and standalone daemons (``SPARK_DAEMON_JAVA_OPTS``) the quick-start options;
    return them for the executors (``spark.executor.extraJavaOptions``)."""
    options = java_options(ensure_archive())
    for name in ("SPARK_SUBMIT_OPTS", "SPARK_DAEMON_JAVA_OPTS"):
        if options not in environ.get(name, ""):  # xdist workers inherit the controller's
            environ[name] = f"{environ.get(name, '')} {options}".strip()
    return options
