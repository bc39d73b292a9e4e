"""How the tests make Spark sessions: one SparkContext per process, each new session with only its
own settings.

No side effects at import, so a test's own subprocess can use it (``tests/scripts/two_sessions.py``).
"""

from __future__ import annotations

import time
from typing import Any

#: the settings the process's driver JVM was launched with: PySpark hands a new gateway's settings to
#: spark-submit, which keeps them as JVM system properties, and every later SparkConf of the process
#: reads those (a first session's 64m maxResultSize once failed a later local[2] test's 110 MiB result)
_LAUNCH_SETTINGS: set[str] = set()


def stop_active() -> None:
    """Stop the process's active session and SparkContext, if any (the driver JVM stays)."""
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        active.stop()
    if SparkContext._active_spark_context is not None:
        SparkContext._active_spark_context.stop()


def forget_launch_settings() -> None:
    """Clear the system properties the driver JVM kept from the session that launched it, so the next
    session has only its own settings (a JVM that is gone keeps nothing)."""
    from pyspark import SparkContext

    if SparkContext._jvm is not None:
        for key in _LAUNCH_SETTINGS:
            SparkContext._jvm.System.clearProperty(key)
    _LAUNCH_SETTINGS.clear()


def make_session(
    master: str, conf: dict[str, str] | None = None, *, executor_java_options: str = "", **underscored: str
) -> Any:
    """A fresh session on ``master`` (stopping any other) with test-friendly settings and no setting
    of an earlier session of the process.

    Extra settings come as ``conf`` (Spark keys) or keywords with dots written as underscores.
    """
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    stop_active()
    forget_launch_settings()
    settings = {
        "spark.master": master,
        "spark.app.name": "spark-torch-tests",
        "spark.driver.host": "127.0.0.1",
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.catalogImplementation": "in-memory",
    }
    if executor_java_options:
        settings["spark.executor.extraJavaOptions"] = executor_java_options
    settings.update(conf or {})
    settings.update({key.replace("_", "."): value for key, value in underscored.items()})
    launches = SparkContext._gateway is None
    builder = SparkSession.builder
    for key, value in settings.items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    if launches:
        _LAUNCH_SETTINGS.update(settings)
    return session


def wait_for_slots(spark: Any, needed: int, seconds: float = 120.0, *, then_go_on: bool = False) -> bool:
    """Block until the cluster's executors registered ``needed`` task slots (True), at most
    ``seconds``: then raise, or with ``then_go_on`` return False (a spark-submit driver that lets
    the library's own check say what is missing)."""
    from spark_torch.driver.spark.cluster import available_slots

    deadline = time.monotonic() + seconds
    while (available_slots(spark) or 0) < needed:
        if time.monotonic() > deadline:
            if then_go_on:
                return False
            raise RuntimeError(f"executors with {needed} task slots did not register within {seconds:g}s")
        time.sleep(0.25)
    return True
