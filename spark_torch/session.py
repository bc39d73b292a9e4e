"""Find the SparkSession to use, or start an embedded local one."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

__all__ = ["active_session", "get_or_create_session"]

logger = logging.getLogger(__name__)


def active_session() -> Any | None:
    """The active SparkSession (classic or Connect), or None.

    If pyspark was never imported there can be no session: pyspark is not imported then (it
    costs ~0.2 s, which local-mode runs need not pay).
    """
    import sys

    if "pyspark.sql" not in sys.modules:
        return None
    from pyspark.sql import SparkSession

    return SparkSession.getActiveSession()


def get_or_create_session(master: str | None = None, conf: dict[str, str] | None = None) -> Any:
    """The active session, or a new embedded session (``local[*]`` unless ``master``) on this interpreter.

    Executors of the embedded session start ``sys.executable`` (PySpark reads PYSPARK_PYTHON
    once, when the SparkContext starts; the driver's environment is restored right after).
    """
    session = active_session()
    if session is not None:
        return session
    from pyspark.sql import SparkSession

    if master is None:
        logger.warning("spark_torch: no active SparkSession; starting an embedded local[*] session")
    saved = os.environ.get("PYSPARK_PYTHON")
    os.environ["PYSPARK_PYTHON"] = sys.executable
    try:
        builder = SparkSession.builder.appName("spark_torch").config("spark.ui.showConsoleProgress", "false")
        builder = builder.master(master or "local[*]")
        for key, value in (conf or {}).items():
            builder = builder.config(key, value)
        return builder.getOrCreate()
    finally:
        if saved is None:
            os.environ.pop("PYSPARK_PYTHON", None)
        else:
            os.environ["PYSPARK_PYTHON"] = saved
