"""``spark-torch doctor``: can this Spark application run spark_torch? A table and the fixes.

It checks what ``run()`` checks, the way ``run()`` does it: the driver's spark_torch is shipped
to the executors (:mod:`spark_torch.driver.spark.shipping`, unless ``ship_package`` is off) and
the executors' Python is probed by :func:`spark_torch.driver.spark.preflight.check_executors`
(the same message and fix as a run); then the versions there, GPUs, TLS and RPC encryption
(from the table of checks a run makes too, :mod:`spark_torch.driver.spark.checks`: what a run
warns about is ``warn``, what it refuses ``FAIL``) and a real 2-rank gloo ``all_reduce``. Every row is printed: a
check that cannot run says why. Exit 0 when a run
would work."""

from __future__ import annotations

import json
import os
import platform
import sys
from dataclasses import dataclass
from typing import Any

from spark_torch.driver.spark.checks import Verdict, encryption_checks
from spark_torch.driver.spark.cluster import ClusterInfo, is_connect_session, read_cluster
from spark_torch.version import __version__

__all__ = ["run_doctor", "Check"]


@dataclass(frozen=True)
class Check:
    """One row of the report."""

    name: str
    value: str
    ok: bool = True
    fix: str = ""
    #: False for a check that could not run (its value says why)
    ran: bool = True
    #: a run goes on, with a warning (the fix says what to change)
    warn: bool = False


def _local_versions() -> dict[str, str]:
    import pyspark

    try:
        import torch

        torch_version = torch.__version__.split("+")[0]
    except ImportError:
        torch_version = "missing"
    return {
        "java": "?",
        "python": platform.python_version(),
        "torch": torch_version,
        "pyspark": pyspark.__version__,
        "spark_torch": __version__,
    }


def _probe(batches: Any) -> Any:
    """Executor side: report versions as one JSON row."""
    import pyarrow as pa

    for _ in batches:
        pass
    versions: dict[str, str] = {"python": platform.python_version()}
    for module in ("torch", "pyspark", "spark_torch"):
        try:
            imported = __import__(module)
            versions[module] = str(getattr(imported, "__version__", "?")).split("+")[0]
        except ImportError:
            versions[module] = "missing"
    import os
    import shutil
    import socket
    import subprocess

    java = os.path.join(os.environ["JAVA_HOME"], "bin", "java") if os.environ.get("JAVA_HOME") else shutil.which("java")
    versions["java"] = "missing"
    if java:
        try:
            done = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=30)
            first = (done.stderr or done.stdout).splitlines()[0]
            versions["java"] = first.split('"')[1] if '"' in first else first.strip()
        except (OSError, subprocess.SubprocessError, IndexError):
            pass
    versions["host"] = socket.gethostname()
    yield pa.RecordBatch.from_pydict({"info": [json.dumps(versions)]})


def _allreduce() -> float:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://")
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.destroy_process_group()
    return t.item()


def _driver_rows(spark: Any, driver: dict[str, str]) -> list[Check]:
    java = "?" if is_connect_session(spark) else str(spark.sparkContext._jvm.System.getProperty("java.version"))
    driver["java"] = java
    torch = driver["torch"] if driver["torch"] != "missing" else "missing (run() does not need it on the driver)"
    return [
        Check("driver python / torch / pyspark", f"{driver['python']} / {torch} / {driver['pyspark']}"),
        Check("driver java / spark", f"{java} / {spark.version}"),
    ]


def _preflight_rows(spark: Any, tasks: int, ship: bool) -> list[Check]:
    """What ``run()`` does before its barrier stage: ship the package, check the executors' Python."""
    from spark_torch.driver.spark.preflight import check_executors
    from spark_torch.driver.spark.shipping import ship_package
    from spark_torch.errors import LaunchError

    rows = []
    if ship:
        try:
            shipped = ship_package(spark)
        except Exception as exc:  # noqa: BLE001 - run() goes on the same way, with the executors' own
            shipped, why = False, _first_line(exc)
        else:
            why = "this driver's spark_torch is not a directory"
        rows.append(Check("spark_torch shipped to the executors", f"yes ({__version__})" if shipped else f"no: {why}"))
    else:
        rows.append(
            Check(
                "spark_torch shipped to the executors",
                f"no (ship_package is off: the executors need spark_torch {__version__})",
            )
        )
    try:
        check_executors(spark, tasks, ship)
        rows.append(Check("executors' Python (run()'s check)", "can run spark_torch"))
    except LaunchError as exc:
        message, _, fix = str(exc).partition(". ")
        rows.append(Check("executors' Python (run()'s check)", message, False, fix))
    return rows


def _first_line(exc: BaseException) -> str:
    """The first line of an error, without a node's encoded report, at most 300 characters."""
    from spark_torch.driver.run.failures import without_reports

    text = without_reports(str(exc)).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__


def _executor_rows(spark: Any, tasks: int, driver: dict[str, str]) -> list[Check]:
    try:
        rows = spark.range(0, tasks, 1, tasks).mapInArrow(_probe, "info string").collect()
        executors = [json.loads(r["info"]) for r in rows]
    except Exception as exc:  # noqa: BLE001 - reported as a failed check
        return [
            Check(
                "executor versions",
                f"probe failed: {_first_line(exc)}",
                False,
                "see the executors' Python row; the executors need pyarrow (README: Install)",
            )
        ]
    hosts = sorted({e["host"] for e in executors})
    checks = [Check("executor hosts probed", f"{len(hosts)} ({', '.join(hosts[:4])}{'...' if len(hosts) > 4 else ''})")]
    java, java_seen = driver["java"], sorted({e.get("java", "?") for e in executors})
    major = {v.split(".")[0] for v in java_seen} | ({java.split(".")[0]} if java != "?" else set())
    checks.append(
        Check(
            "executor java",
            ", ".join(java_seen),
            len(major) == 1 and "missing" not in java_seen,
            f"use the same Java major version as the driver ({java}) on every executor",
        )
    )
    for key in ("python", "torch", "pyspark", "spark_torch"):
        seen = sorted({e[key] for e in executors})
        checks.append(
            Check(f"executor {key}", ", ".join(seen), _agrees(key, seen, driver[key]), _fix(key, driver[key]))
        )
    return checks


def _agrees(key: str, seen: list[str], driver: str) -> bool:
    """What run() needs: Python and PySpark as the driver's major.minor, torch on every executor
    (one version), the driver's spark_torch (shipped, or installed the same)."""
    if "missing" in seen:
        return False
    if key in ("python", "pyspark"):
        return {".".join(v.split(".")[:2]) for v in seen} == {".".join(driver.split(".")[:2])}
    if key == "torch":
        return len(seen) == 1
    return seen == [driver]


def _fix(key: str, driver: str) -> str:
    if key == "torch":
        return "install one torch version into every executor's Python"
    if key == "spark_torch":
        return f"leave the ship_package setting on, or install spark_torch {driver} on every executor"
    return f"use the driver's {key} {'.'.join(driver.split('.')[:2])} on every executor" + (
        " (set PYSPARK_PYTHON)" if key == "python" else ""
    )


def _allreduce_row(spark: Any, slots: int | None, failed: list[Check]) -> Check:
    ranks = 2 if (slots is None or slots >= 2) else 1
    name = f"{ranks}-rank gloo all_reduce"
    if failed:
        return Check(name, f"not run: {', '.join(c.name for c in failed)} failed first", ran=False)
    from spark_torch.driver.api.distributor import Distributor

    fix = "check that executors can reach each other (GLOO_SOCKET_IFNAME)"
    try:
        value = Distributor(num_processes=ranks, local_mode=False, spark=spark, timeout=300, log_ranks=[]).run(
            _allreduce
        )
    except Exception as exc:  # noqa: BLE001 - reported as a failed check
        return Check(name, _first_line(exc), False, fix)
    return Check(name, f"ok ({value:g})", value == ranks, fix)


def shared_rows(cluster: ClusterInfo) -> list[Check]:
    """The rows of the checks a run makes too, from the one table both read
    (:mod:`spark_torch.driver.spark.checks`): what a run warns about is ``warn`` here, what it
    refuses ``FAIL``."""
    return [
        Check(c.name, c.value, c.verdict is not Verdict.FAIL, c.fix, warn=c.verdict is Verdict.WARN)
        for c in encryption_checks(cluster)
    ]


def collect_checks(spark: Any) -> list[Check]:
    """Run every check against ``spark``: the driver, what ``run()`` checks before its barrier
    stage (the package shipped, the executors' Python), the executors' versions, GPUs, TLS, and
    a real all_reduce unless an earlier check failed (its row then says why it did not run)."""
    from spark_torch.driver.spark.slots import settled_slots
    from spark_torch.settings import resolve

    driver = _local_versions()
    checks = _driver_rows(spark, driver)
    cluster = read_cluster(spark)
    checks.append(Check("master", cluster.master))
    settings = resolve({}, os.environ, cluster.torch_conf)
    # as run() does: a fresh cluster's executors register over seconds (up to executor_wait)
    slots = settled_slots(spark, settings.executor_wait)
    checks.append(
        Check(
            "free task slots",
            "unknown (Spark Connect)" if slots is None else str(slots),
            slots is None or slots >= 1,
            "start executors or lower spark.task.cpus",
        )
    )
    tasks = max(1, min(slots or 2, 8))
    ship = settings.ship_package
    checks += _preflight_rows(spark, tasks, ship)
    checks += _executor_rows(spark, tasks, driver)
    checks.append(
        Check("GPUs per executor / per task", f"{cluster.executor_gpu_amount:g} / {cluster.task_gpu_amount:g}")
    )
    checks += shared_rows(cluster)
    checks.append(_allreduce_row(spark, slots, [c for c in checks if not c.ok]))
    return checks


def format_table(checks: list[Check]) -> str:
    """A plain-text table: status, check, value, and the fix when it failed."""
    width = max(len(c.name) for c in checks)
    lines = []
    for check in checks:
        mark = "FAIL" if not check.ok else "skip" if not check.ran else "warn" if check.warn else "ok  "
        lines.append(f"{mark}  {check.name.ljust(width)}  {check.value}")
        if (not check.ok or check.warn) and check.fix:
            lines.append(f"      {' ' * width}  fix: {check.fix}")
    return "\n".join(lines)


def run_doctor(spark: Any) -> int:
    """Print the report; 0 if a run would work, 1 otherwise. Spark's task-failure logs are quiet
    meanwhile, as during a run (the ``spark_logs`` setting keeps them)."""
    from spark_torch.driver.spark.quiet import quiet_spark_logs
    from spark_torch.settings import resolve

    keep = resolve({}, os.environ, read_cluster(spark).torch_conf).spark_logs
    with quiet_spark_logs(spark, keep=keep):
        checks = collect_checks(spark)
    print(format_table(checks))
    failed = [c for c in checks if not c.ok]
    skipped = [c for c in checks if c.ok and not c.ran]
    warned = [c for c in checks if c.ok and c.ran and c.warn]
    print(
        f"\n{len(checks) - len(failed) - len(skipped) - len(warned)} checks passed, {len(failed)} failed"
        + (f", {len(warned)} with a warning a run would print too" if warned else "")
        + (f", {len(skipped)} not run" if skipped else ""),
        file=sys.stdout,
    )
    return 1 if failed else 0
