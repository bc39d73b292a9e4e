"""Find the SparkSession to use, or start one (embedded ``local[*]``, a cluster master, or a
Spark Connect endpoint), failing in seconds with one line when the master cannot be reached."""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Any

__all__ = ["active_session", "get_or_create_session", "executor_python", "master_endpoints", "check_master_reachable"]

logger = logging.getLogger(__name__)

_SESSION_LOCK = threading.Lock()
#: how long one master address may take to accept a TCP connection
CONNECT_SECONDS = 5.0
_DEFAULT_PORTS = {"spark": 7077, "sc": 15002}
#: the Spark key naming the executors' Python (read by spark-submit)
PYSPARK_PYTHON_KEY = "spark.pyspark.python"


def master_endpoints(master: str) -> list[tuple[str, int]]:
    """The (host, port) pairs of a ``spark://h1:p1,h2:p2`` or ``sc://host:port/;params`` URL
    (empty for other masters: local, yarn, k8s...)."""
    scheme, sep, rest = master.partition("://")
    if not sep or scheme not in _DEFAULT_PORTS:
        return []
    rest = rest.split("/", 1)[0].split(";", 1)[0]
    endpoints = []
    for part in rest.split(","):
        part = part.strip()
        if not part:
            continue
        if part.startswith("["):  # [ipv6]:port
            host, _, tail = part[1:].partition("]")
            port_text = tail[1:] if tail.startswith(":") else ""
        else:
            host, _, port_text = part.rpartition(":") if part.count(":") == 1 else (part, "", "")
        try:
            port = int(port_text) if port_text else _DEFAULT_PORTS[scheme]
        except ValueError:
            port = _DEFAULT_PORTS[scheme]
        endpoints.append((host, port))
    return endpoints


def check_master_reachable(master: str, timeout: float = CONNECT_SECONDS) -> None:
    """Raise :class:`~spark_torch.errors.LaunchError` (one line, with what to check) unless some
    address of a ``spark://`` / ``sc://`` master accepts a TCP connection within ``timeout``."""
    import socket

    from spark_torch.errors import LaunchError

    endpoints = master_endpoints(master)
    errors = []
    for host, port in endpoints:
        try:
            with socket.create_connection((host, port), timeout=timeout):
                return
        except OSError as exc:
            errors.append(f"{host}:{port}: {exc.strerror or exc}")
    if endpoints:
        raise LaunchError(
            f"no Spark master answers at {master} ({'; '.join(errors)}). Check the URL (host and "
            f"port: {'7077' if master.startswith('spark') else '15002'} by default), that the master "
            "is running, and that this machine can reach it (firewall, VPN, DNS)"
        )


def _unresponsive(exc: BaseException, master: str) -> BaseException:
    """Spark's 'All masters are unresponsive' (a page of Java and Python frames) as one line."""
    from spark_torch.errors import LaunchError

    if "All masters are unresponsive" in str(exc):
        return LaunchError(
            f"the Spark master at {master} accepted a connection but never answered as a Spark master "
            "(Spark gave up: 'All masters are unresponsive'). Check that the URL points at the "
            "master's RPC port (7077 by default, not its web UI) and that its Spark version matches this pyspark"
        )
    return exc


def _import_session_class() -> Any:
    try:
        from pyspark.sql import SparkSession
    except ImportError as exc:
        raise ImportError(
            "distributed mode needs PySpark: install it with `pip install 'spark-torch[spark]'`, or "
            "use the cluster's own pyspark (Databricks, EMR, Dataproc provide one). Local mode "
            "(local_mode=True) needs no Spark at all"
        ) from exc
    return SparkSession


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

    Executors of the embedded session start :func:`executor_python` (PySpark reads PYSPARK_PYTHON
    once, when the SparkContext starts; the driver's environment is restored right after). Before
    a classic session starts, :func:`~spark_torch.driver.java.check_java` makes sure a Java Spark
    can run on is there.
    """
    with _SESSION_LOCK:  # PYSPARK_PYTHON is process-global; two run() calls must not interleave here
        session = active_session()
        if session is not None:
            return session
        return _start_session(master, conf)


def executor_python(conf: dict[str, str] | None) -> str:
    """The interpreter the executors of an embedded session run: ``spark.pyspark.python`` when
    given in ``conf`` (a session started in this process ignores that key otherwise: only
    spark-submit reads it), else this driver's own. The executors' check
    (:mod:`spark_torch.driver.preflight`) names both in its advice."""
    return (conf or {}).get(PYSPARK_PYTHON_KEY) or sys.executable


def _check_java() -> None:
    """Before PySpark starts a JVM: one line when Java is missing or too old (not its Py4J traceback)."""
    import pyspark
    from pyspark import SparkContext

    if SparkContext._gateway is not None or os.environ.get("PYSPARK_GATEWAY_PORT"):
        return  # a JVM is already there (an earlier session, or spark-submit started this driver)
    from spark_torch.driver.java import check_java

    check_java(pyspark.__version__)


def _start_session(master: str | None, conf: dict[str, str] | None) -> Any:
    SparkSession = _import_session_class()  # noqa: N806 - a class
    if master:
        check_master_reachable(master)
    if master and master.startswith("sc://"):
        return SparkSession.builder.remote(master).getOrCreate()
    _check_java()
    if master is None:
        logger.warning("spark_torch: no active SparkSession; starting an embedded local[*] session")
    saved = os.environ.get("PYSPARK_PYTHON")
    os.environ["PYSPARK_PYTHON"] = executor_python(conf)
    try:
        builder = SparkSession.builder.appName("spark_torch").config("spark.ui.showConsoleProgress", "false")
        builder = builder.master(master or "local[*]")
        for key, value in (conf or {}).items():
            builder = builder.config(key, value)
        try:
            return builder.getOrCreate()
        except Exception as exc:
            raise _unresponsive(exc, master or "local[*]") from None
    finally:
        if saved is None:
            os.environ.pop("PYSPARK_PYTHON", None)
        else:
            os.environ["PYSPARK_PYTHON"] = saved
