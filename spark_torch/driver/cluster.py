"""A snapshot of what Spark offers this run. The only module that reads Spark conf/resources."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

__all__ = ["ClusterInfo", "read_cluster", "IGNORE_SSL_KEY"]

logger = logging.getLogger(__name__)

IGNORE_SSL_KEY = "pytorch.spark.distributor.ignoreSsl"


@dataclass(frozen=True)
class ClusterInfo:
    """Spark facts a plan depends on; plain data so planning is testable without Spark."""

    master: str = ""
    driver_host: str = "127.0.0.1"
    task_cpus: int = 1
    task_gpu_amount: float = 0.0
    executor_gpu_amount: float = 0.0
    driver_gpu_amount: float = 0.0
    driver_gpu_addresses: tuple[str, ...] = ()
    ssl_enabled: bool = False
    ignore_ssl: bool = False
    is_connect: bool = False
    #: ``spark.driver.bindAddress`` (classic sessions), None when unset
    driver_bind_address: str | None = None
    #: Spark Connect: the host of the Connect server this client talks to
    connect_host: str | None = None
    #: raw ``spark.torch.channel.ports`` / ``spark.torch.rendezvous.timeout`` (checked in endpoints)
    channel_ports: str | None = None
    rendezvous_timeout: str | None = None
    #: ``spark.executorEnv.OMP_NUM_THREADS``: the cluster chose the ranks' thread count
    executor_threads: str | None = None


def _conf(spark: Any, key: str, default: str | None = None) -> str | None:
    try:
        value = spark.conf.get(key, default)
    except Exception:  # Spark Connect raises for unknown keys on some versions
        return default
    return default if value is None else str(value)


def _float(spark: Any, key: str) -> float:
    raw = _conf(spark, key)
    if raw is None or raw == "":
        return 0.0
    try:
        return float(raw)
    except ValueError as exc:
        from spark_torch.errors import ConfigurationError

        raise ConfigurationError(f"Spark conf {key}={raw!r} is not a number") from exc


def _is_true(value: str | None) -> bool:
    return (value or "").strip().lower() == "true"


def is_connect_session(spark: Any) -> bool:
    """True for a Spark Connect client session (no SparkContext on this side)."""
    return type(spark).__module__.startswith("pyspark.sql.connect")


def read_cluster(spark: Any) -> ClusterInfo:
    """Read the Spark conf and driver resources once into a :class:`ClusterInfo`."""
    connect = is_connect_session(spark)
    addresses: tuple[str, ...] = ()
    master = _conf(spark, "spark.master", "") or ""
    if not connect:
        sc = spark.sparkContext
        master = sc.master
        gpu = sc.resources.get("gpu")
        if gpu is not None:
            addresses = tuple(sorted(gpu.addresses, key=lambda a: (len(a), a)))
    connect_host = None
    if connect:
        builder = getattr(getattr(spark, "client", None), "_builder", None)
        connect_host = getattr(builder, "host", None)
    task_cpus_raw = _conf(spark, "spark.task.cpus", "1") or "1"
    try:
        task_cpus = int(task_cpus_raw)
    except ValueError:
        task_cpus = 1
    return ClusterInfo(
        master=master,
        driver_host=_conf(spark, "spark.driver.host", "127.0.0.1") or "127.0.0.1",
        task_cpus=max(1, task_cpus),
        task_gpu_amount=_float(spark, "spark.task.resource.gpu.amount"),
        executor_gpu_amount=_float(spark, "spark.executor.resource.gpu.amount"),
        driver_gpu_amount=_float(spark, "spark.driver.resource.gpu.amount"),
        driver_gpu_addresses=addresses,
        ssl_enabled=_is_true(_conf(spark, "spark.ssl.enabled"))
        or _is_true(_conf(spark, "spark.network.crypto.enabled")),
        ignore_ssl=_is_true(_conf(spark, IGNORE_SSL_KEY)),
        is_connect=connect,
        driver_bind_address=None if connect else _conf(spark, "spark.driver.bindAddress"),
        connect_host=connect_host,
        channel_ports=_conf(spark, "spark.torch.channel.ports"),
        rendezvous_timeout=_conf(spark, "spark.torch.rendezvous.timeout"),
        executor_threads=_conf(spark, "spark.executorEnv.OMP_NUM_THREADS"),
    )
