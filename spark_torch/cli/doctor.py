"""``spark-torch doctor``: can this Spark application run spark_torch? A table and the fixes."""

from __future__ import annotations

import json
import platform
import sys
from dataclasses import dataclass
from typing import Any

from spark_torch.driver.spark.cluster import IGNORE_SSL_KEY, is_connect_session, read_cluster
from spark_torch.version import __version__

__all__ = ["run_doctor", "Check"]


@dataclass(frozen=True)
class Check:
    """One row of the report."""

    name: str
    value: str
    ok: bool = True
    fix: str = ""


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


def collect_checks(spark: Any) -> list[Check]:
    """Run every check against ``spark``."""
    from spark_torch.driver.spark.cluster import available_slots

    checks: list[Check] = []
    driver = _local_versions()
    java = "?"
    if not is_connect_session(spark):
        java = str(spark.sparkContext._jvm.System.getProperty("java.version"))
    checks.append(Check("driver python / torch / pyspark", f"{driver['python']} / {driver['torch']} / {driver['pyspark']}",
                        driver["torch"] != "missing", "pip install torch on the driver"))
    checks.append(Check("driver java / spark", f"{java} / {spark.version}"))
    cluster = read_cluster(spark)
    checks.append(Check("master", cluster.master))
    slots = available_slots(spark)
    checks.append(Check("free task slots", "unknown (Spark Connect)" if slots is None else str(slots),
                        slots is None or slots >= 1, "start executors or lower spark.task.cpus"))
    tasks = max(1, min(slots or 2, 8))
    try:
        rows = spark.range(0, tasks, 1, tasks).mapInArrow(_probe, "info string").collect()
        executors = [json.loads(r["info"]) for r in rows]
    except Exception as exc:  # noqa: BLE001 - reported as a failed check
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        checks.append(Check("executors", f"probe failed: {first}", False,
                            "install spark-torch, torch, pyarrow and pandas<3 on the executors and set PYSPARK_PYTHON"))
        executors = []
    hosts = sorted({e["host"] for e in executors})
    if executors:
        checks.append(Check("executor hosts probed", f"{len(hosts)} ({', '.join(hosts[:4])}{'...' if len(hosts) > 4 else ''})"))
    if executors:
        java_seen = sorted({e.get("java", "?") for e in executors})
        major = {v.split(".")[0] for v in java_seen} | ({java.split(".")[0]} if java != "?" else set())
        checks.append(Check("executor java", ", ".join(java_seen), len(major) == 1 and "missing" not in java_seen,
                            f"use the same Java major version as the driver ({java}) on every executor"))
    for key in ("python", "torch", "pyspark", "spark_torch"):
        seen = sorted({e[key] for e in executors})
        if not seen:
            continue
        mismatch = seen != [driver[key]] or "missing" in seen
        checks.append(Check(f"executor {key}", ", ".join(seen), not mismatch,
                            f"use the same {key} ({driver[key]}) on the driver and every executor"
                            + (" (set PYSPARK_PYTHON)" if key == "python" else "")))
    checks.append(Check("GPUs per executor / per task", f"{cluster.executor_gpu_amount:g} / {cluster.task_gpu_amount:g}"))
    checks.append(Check("TLS (spark.ssl.enabled)", "on" if cluster.ssl_enabled else "off",
                        not cluster.ssl_enabled or cluster.ignore_ssl,
                        f"torch traffic is not encrypted; set {IGNORE_SSL_KEY}=true to run anyway"))
    crypto = "on (spark_torch's channel is encrypted; gloo/NCCL traffic is not)" if cluster.crypto_enabled else "off"
    checks.append(Check("RPC encryption (spark.network.crypto.enabled)", crypto))
    if all(c.ok for c in checks):
        from spark_torch.driver.api.distributor import Distributor

        ranks = 2 if (slots is None or slots >= 2) else 1
        try:
            value = Distributor(num_processes=ranks, local_mode=False, spark=spark, timeout=300, log_ranks=[]).run(_allreduce)
            checks.append(Check(f"{ranks}-rank gloo all_reduce", f"ok ({value:g})", value == ranks,
                                "check that executors can reach each other (GLOO_SOCKET_IFNAME)"))
        except Exception as exc:  # noqa: BLE001 - reported as a failed check
            checks.append(Check(f"{ranks}-rank gloo all_reduce", str(exc).splitlines()[0][:300], False,
                                "check that executors can reach each other (GLOO_SOCKET_IFNAME)"))
    return checks


def format_table(checks: list[Check]) -> str:
    """A plain-text table: status, check, value, and the fix when it failed."""
    width = max(len(c.name) for c in checks)
    lines = []
    for check in checks:
        mark = "ok  " if check.ok else "FAIL"
        lines.append(f"{mark}  {check.name.ljust(width)}  {check.value}")
        if not check.ok and check.fix:
            lines.append(f"      {' ' * width}  fix: {check.fix}")
    return "\n".join(lines)


def run_doctor(spark: Any) -> int:
    """Print the report; 0 if a run would work, 1 otherwise."""
    checks = collect_checks(spark)
    print(format_table(checks))
    failed = [c for c in checks if not c.ok]
    print(f"\n{len(checks) - len(failed)} checks passed, {len(failed)} failed", file=sys.stdout)
    return 1 if failed else 0
