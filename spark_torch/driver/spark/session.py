"""Find the SparkSession to use, or start one (embedded ``local[*]``, a cluster master, or a
Spark Connect endpoint), failing in seconds with one line when the master cannot be reached."""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Any

__all__ = [
    "active_session",
    "get_or_create_session",
    "executor_python",
    "master_endpoints",
    "check_master_reachable",
    "embedded_conf",
    "JVM_START_NOISE",
]

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
    a classic session starts, :func:`~spark_torch.driver.spark.java.check_java` makes sure a Java Spark
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
    (:mod:`spark_torch.driver.spark.preflight`) names both in its advice."""
    return (conf or {}).get(PYSPARK_PYTHON_KEY) or sys.executable


def _check_java() -> None:
    """Before PySpark starts a JVM: one line when Java is missing or too old (not its Py4J traceback)."""
    import pyspark
    from pyspark import SparkContext

    if SparkContext._gateway is not None or os.environ.get("PYSPARK_GATEWAY_PORT"):
        return  # a JVM is already there (an earlier session, or spark-submit started this driver)
    from spark_torch.driver.spark.java import check_java

    check_java(pyspark.__version__)


#: the driver JVM's log configuration when the user has none: Spark's own WARN and ERROR lines
#: stay; what every start prints (the default profile's banner, "Setting default log level",
#: Hadoop's native-library notice) does not
_QUIET_LOG4J = """\
# spark_torch: an embedded session's driver logs WARN and above, without start-up notices
rootLogger.level = warn
rootLogger.appenderRef.stderr.ref = stderr
appender.stderr.type = Console
appender.stderr.name = stderr
appender.stderr.target = SYSTEM_ERR
appender.stderr.layout.type = PatternLayout
appender.stderr.layout.pattern = %d{yy/MM/dd HH:mm:ss} %p %c{1}: %m%n%ex
logger.repl.name = org.apache.spark.repl.Main
logger.repl.level = warn
logger.native.name = org.apache.hadoop.util.NativeCodeLoader
logger.native.level = error
logger.jetty.name = org.sparkproject.jetty
logger.jetty.level = error
"""

#: lines a JVM prints on every start, not about the user's run: Spark's log4j banner (gone with
#: the quiet configuration), and the JVM's own notice about the incubator module that Spark's
#: launcher always adds (no JVM option silences it: the embedded session drops the line)
JVM_START_NOISE = (
    "WARNING: Using incubator modules",
    "Using Spark's default log4j profile",
    "Setting default log level to",
    "To adjust logging level use sc.setLogLevel",
    "NativeCodeLoader: Unable to load native-hadoop library",
)
_INCUBATOR_NOTICE = b"WARNING: Using incubator modules"
_DRIVER_JAVA_OPTIONS = "spark.driver.extraJavaOptions"
_JAVA_OPTION_VARS = ("SPARK_SUBMIT_OPTS", "JAVA_TOOL_OPTIONS", "JDK_JAVA_OPTIONS", "_JAVA_OPTIONS")
_LOG4J_FILES = tuple(
    f"log4j2{test}.{ext}" for test in ("", "-test") for ext in ("properties", "xml", "yaml", "yml", "json")
)
_LOOPBACK = "127.0.0.1"
_QUIET_FILE: list[str] = []  # the configuration file written for this process (at most one)


def _spark_conf_dir() -> str | None:
    """Where spark-submit reads log4j2.properties and spark-defaults.conf from."""
    if os.environ.get("SPARK_CONF_DIR"):
        return os.environ["SPARK_CONF_DIR"]
    try:
        from pyspark.find_spark_home import _find_spark_home

        return os.path.join(_find_spark_home(), "conf")
    except Exception:  # noqa: BLE001 - no Spark home found: nothing configured there
        return None


def _user_logging(conf: dict[str, str], environ: dict[str, str] | os._Environ[str]) -> bool:
    """Whether the user configured the driver JVM's logging (or its Java options, which a
    ``--conf`` of ours would replace): then the session starts with exactly their settings."""
    if "log4j" in conf.get(_DRIVER_JAVA_OPTIONS, "").lower():
        return True
    if environ.get("LOG4J_CONFIGURATION_FILE") or any("log4j" in environ.get(v, "").lower() for v in _JAVA_OPTION_VARS):
        return True
    conf_dir = _spark_conf_dir()
    if conf_dir is None:
        return False
    if any(os.path.exists(os.path.join(conf_dir, name)) for name in _LOG4J_FILES):
        return True
    try:
        with open(os.path.join(conf_dir, "spark-defaults.conf"), encoding="utf-8", errors="replace") as fh:
            return _DRIVER_JAVA_OPTIONS not in conf and any(line.split()[:1] == [_DRIVER_JAVA_OPTIONS] for line in fh)
    except OSError:
        return False


def _quiet_log4j_file() -> str:
    """This process's quiet log4j2 configuration (written once, removed at exit)."""
    if not _QUIET_FILE:
        import atexit
        import tempfile

        fd, path = tempfile.mkstemp(prefix="spark_torch_log4j2_", suffix=".properties")
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(_QUIET_LOG4J)
        atexit.register(_remove_file, path)
        _QUIET_FILE.append(path)
    return _QUIET_FILE[0]


def _is_local_master(master: str) -> bool:
    return master == "local" or master.startswith("local[")


def embedded_conf(
    master: str, conf: dict[str, str] | None, environ: dict[str, str] | os._Environ[str] = os.environ
) -> dict[str, str]:
    """The configuration spark_torch adds to the user's for a session it starts itself:

    - a quiet driver log (WARN and above, no start-up notices) unless the user configured
      log4j (``spark.driver.extraJavaOptions``, a ``log4j2.*`` file in Spark's conf directory,
      Java option variables, ``LOG4J_CONFIGURATION_FILE``);
    - with a ``local`` master and neither ``SPARK_LOCAL_IP`` nor ``spark.driver.host`` /
      ``spark.driver.bindAddress`` given: the driver on loopback (127.0.0.1), so that a laptop
      on a network that does not route to its own hostname's address still runs.
    """
    result = dict(conf or {})
    if not _user_logging(result, environ):
        option = f"-Dlog4j2.configurationFile=file:{_quiet_log4j_file()}"
        result[_DRIVER_JAVA_OPTIONS] = f"{result.get(_DRIVER_JAVA_OPTIONS, '')} {option}".strip()
    if _on_loopback(master, result, environ):
        result.update({"spark.driver.host": _LOOPBACK, "spark.driver.bindAddress": _LOOPBACK})
    return result


def _on_loopback(master: str, conf: dict[str, str], environ: dict[str, str] | os._Environ[str]) -> bool:
    """A local master, and the user chose no address (see :func:`embedded_conf`)."""
    chosen = {"spark.driver.host", "spark.driver.bindAddress"} & set(conf)
    return _is_local_master(master) and not chosen and not environ.get("SPARK_LOCAL_IP")


def _jvm_environment(master: str, conf: dict[str, str] | None) -> dict[str, str]:
    """Variables the driver JVM starts with (PySpark copies ``os.environ`` when it starts the
    JVM; they are set for that moment only): the executors' Python, and for a loopback session
    ``SPARK_LOCAL_IP`` too, which Spark's web UI binds and which spares the JVM's notice about
    this host's name resolving to a loopback address."""
    env = {"PYSPARK_PYTHON": executor_python(conf)}
    if _on_loopback(master, dict(conf or {}), os.environ):
        env["SPARK_LOCAL_IP"] = _LOOPBACK
    return env


def _forward_stderr(pipe: Any, target: int) -> None:
    """Copy the driver JVM's stderr to file descriptor ``target``, without the JVM's
    incubator-module notice (a descriptor, not ``sys.stderr``: Jupyter captures descriptor 2
    into the cell, as it did when the JVM wrote there itself)."""
    with pipe:
        for line in iter(pipe.readline, b""):
            if not line.startswith(_INCUBATOR_NOTICE):
                try:
                    os.write(target, line)
                except OSError:
                    return


def _launch_quiet_gateway(spark_conf: Any) -> Any:
    """PySpark's gateway JVM, its stderr passed through :func:`_forward_stderr` (PySpark's
    ``launch_gateway`` takes ``popen_kwargs`` for this)."""
    from subprocess import PIPE

    from pyspark.java_gateway import launch_gateway

    gateway = launch_gateway(spark_conf, popen_kwargs={"stderr": PIPE})  # type: ignore[no-untyped-call]
    if gateway.proc is not None and gateway.proc.stderr is not None:
        threading.Thread(
            target=_forward_stderr,
            args=(gateway.proc.stderr, 2),  # where the JVM would have written
            name="spark_torch-jvm-stderr",
            daemon=True,
        ).start()
    return gateway


def _start_session(master: str | None, conf: dict[str, str] | None) -> Any:
    SparkSession = _import_session_class()  # noqa: N806 - a class
    if master:
        check_master_reachable(master)
    if master and master.startswith("sc://"):
        return SparkSession.builder.remote(master).getOrCreate()
    _check_java()
    if master is None:
        logger.warning("spark_torch: no active SparkSession; starting an embedded local[*] session")
    settings = embedded_conf(master or "local[*]", conf)  # before SPARK_LOCAL_IP is set below
    env = _jvm_environment(master or "local[*]", conf)
    saved: dict[str, str | None] = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        from pyspark import SparkConf, SparkContext

        spark_conf = SparkConf().setAppName("spark_torch").set("spark.ui.showConsoleProgress", "false")
        spark_conf.setMaster(master or "local[*]")
        for key, value in settings.items():
            spark_conf.set(key, value)
        try:
            gateway = None
            if SparkContext._gateway is None and not os.environ.get("PYSPARK_GATEWAY_PORT"):
                gateway = _launch_quiet_gateway(spark_conf)
            SparkContext(conf=spark_conf, gateway=gateway)
            return SparkSession.builder.getOrCreate()
        except Exception as exc:
            raise _unresponsive(exc, master or "local[*]") from None
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


def _remove_file(path: str) -> None:
    if os.path.exists(path):
        os.unlink(path)
