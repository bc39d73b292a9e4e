"""What Spark offers this run. The only module that reads Spark conf, resources and slots.

:func:`read_cluster` takes a snapshot of the conf a plan depends on (including the
``spark.torch.*`` keys of :mod:`spark_torch.settings`); :func:`available_slots` asks the
scheduler (or, for a Spark Connect client, the conf) how many tasks can run at once;
:func:`executor_hosts` the addresses of the executors it knows (the channel's trusted addresses).
"""

from __future__ import annotations

import logging
import re
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from spark_torch.channel.handshake_slots import normalize_address
from spark_torch.errors import ConfigurationError
from spark_torch.settings import SETTINGS

__all__ = [
    "ClusterInfo",
    "read_cluster",
    "IGNORE_SSL_KEY",
    "DEEPSPEED_IGNORE_SSL_KEY",
    "is_connect_session",
    "available_slots",
    "slots_from_conf",
    "session_conf",
    "unencrypted_rpc_warning",
    "executor_hosts",
    "is_local_master",
]

logger = logging.getLogger(__name__)

IGNORE_SSL_KEY = "pytorch.spark.distributor.ignoreSsl"
#: PySpark's DeepspeedTorchDistributor reads this key instead
DEEPSPEED_IGNORE_SSL_KEY = "deepspeed.spark.distributor.ignoreSsl"


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
    #: ``spark.ssl.enabled``: the cluster requires TLS (refused unless ``ignore_ssl``, as TorchDistributor does)
    ssl_enabled: bool = False
    #: ``spark.network.crypto.enabled``: Spark encrypts its RPC (runs; gloo/NCCL are not encrypted)
    crypto_enabled: bool = False
    #: ``spark.ssl.rpc.enabled`` (Spark 4): Spark's RPC over TLS
    rpc_ssl_enabled: bool = False
    ignore_ssl: bool = False
    is_connect: bool = False
    #: ``spark.driver.bindAddress`` (classic sessions), None when unset
    driver_bind_address: str | None = None
    #: Spark Connect: the host of the Connect server this client talks to
    connect_host: str | None = None
    #: the ``spark.torch.*`` keys of :data:`spark_torch.settings.SETTINGS` that are set (raw text)
    torch_conf: Mapping[str, str] = field(default_factory=dict)
    #: ``spark.executorEnv.OMP_NUM_THREADS``: the cluster chose the ranks' thread count
    executor_threads: str | None = None


def is_local_master(master: str) -> bool:
    """``local``, ``local[N]``, ``local[*]``, ``local[N,F]``: every task runs in the driver."""
    return master == "local" or master.startswith("local[")


def session_conf(spark: Any, key: str, default: str | None = None) -> str | None:
    """The session's setting ``key`` as text (``default`` when unset or unreadable)."""
    try:
        value = spark.conf.get(key, default)
    except Exception:  # Spark Connect raises for unknown keys on some versions
        return default
    return default if value is None else str(value)


def _float(spark: Any, key: str) -> float:
    raw = session_conf(spark, key)
    if raw is None or raw == "":
        return 0.0
    try:
        return float(raw)
    except ValueError as exc:
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
    master = session_conf(spark, "spark.master", "") or ""
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
    task_cpus_raw = session_conf(spark, "spark.task.cpus", "1") or "1"
    try:
        task_cpus = int(task_cpus_raw)
    except ValueError:
        task_cpus = 1
    return ClusterInfo(
        master=master,
        driver_host=session_conf(spark, "spark.driver.host", "127.0.0.1") or "127.0.0.1",
        task_cpus=max(1, task_cpus),
        task_gpu_amount=_float(spark, "spark.task.resource.gpu.amount"),
        executor_gpu_amount=_float(spark, "spark.executor.resource.gpu.amount"),
        driver_gpu_amount=_float(spark, "spark.driver.resource.gpu.amount"),
        driver_gpu_addresses=addresses,
        ssl_enabled=_is_true(session_conf(spark, "spark.ssl.enabled")),
        crypto_enabled=_is_true(session_conf(spark, "spark.network.crypto.enabled")),
        rpc_ssl_enabled=_is_true(session_conf(spark, "spark.ssl.rpc.enabled")),
        ignore_ssl=_is_true(session_conf(spark, IGNORE_SSL_KEY))
        or _is_true(session_conf(spark, DEEPSPEED_IGNORE_SSL_KEY)),
        is_connect=connect,
        driver_bind_address=None if connect else session_conf(spark, "spark.driver.bindAddress"),
        connect_host=connect_host,
        torch_conf={s.conf: v for s in SETTINGS if (v := session_conf(spark, s.conf)) is not None},
        executor_threads=session_conf(spark, "spark.executorEnv.OMP_NUM_THREADS"),
    )


def unencrypted_rpc_warning(cluster: ClusterInfo) -> str | None:
    """The warning for a distributed run whose Spark RPC is not encrypted on a real cluster (not a
    ``local`` master, whose tasks never leave this machine's processes), else None. The run's
    channel secret travels to the executors inside the task (the run spec in its closure), so
    an observer of that traffic learns it and can then read the channel."""
    if cluster.crypto_enabled or cluster.rpc_ssl_enabled or re.fullmatch(r"local(\[.*\])?", cluster.master.strip()):
        return None
    return (
        "spark_torch: Spark's RPC is not encrypted (spark.network.crypto.enabled is off): the run's channel "
        "secret reaches the executors inside the Spark task, so whoever can watch the network between the "
        "driver and the executors can read the ranks' logs, metrics and results on spark_torch's channel too. "
        "Set spark.authenticate=true and spark.network.crypto.enabled=true to keep them confidential"
    )


def slots_from_conf(conf: Callable[[str], str | None]) -> int | None:
    """Task slots a cluster offers, from its configuration alone (Spark Connect clients cannot ask
    the scheduler): ``local[N]``, ``local-cluster[N,C,M]``, or a static executor allocation.
    None when the configuration does not say (``local[*]`` on an unknown server, dynamic
    allocation)."""
    try:
        task_cpus = max(1, int(conf("spark.task.cpus") or "1"))
    except ValueError:
        task_cpus = 1
    master = (conf("spark.master") or "").strip()
    if master == "local":
        return 1 // task_cpus
    match = re.fullmatch(r"local\[(\d+)(?:,\d+)?\]", master)
    if match:
        return int(match.group(1)) // task_cpus
    match = re.fullmatch(r"local-cluster\[(\d+),\s*(\d+),\s*\d+\]", master)
    if match:
        return int(match.group(1)) * (int(match.group(2)) // task_cpus)
    if (conf("spark.dynamicAllocation.enabled") or "").lower() == "true":
        return None
    try:
        instances, cores = int(conf("spark.executor.instances") or ""), int(conf("spark.executor.cores") or "")
    except ValueError:
        return None
    return instances * (cores // task_cpus)


def available_slots(spark: Any) -> int | None:
    """Task slots the cluster offers at once for the default resource profile (None: unknown)."""
    if is_connect_session(spark):
        return slots_from_conf(lambda key: session_conf(spark, key))
    jsc = spark.sparkContext._jsc.sc()
    profile = jsc.resourceProfileManager().defaultResourceProfile()
    return int(jsc.maxNumConcurrentTasks(profile))


def master_of(spark: Any) -> str:
    """The session's master URL (``spark.master`` of a Connect client's conf)."""
    return (
        str(session_conf(spark, "spark.master", "") or "")
        if is_connect_session(spark)
        else str(spark.sparkContext.master)
    )


#: on a local master every node runs on this machine and may connect over loopback
LOOPBACK = frozenset({"127.0.0.1", "::1"})


def _addresses(host: str) -> set[str]:
    """The IP addresses ``host`` (a name or an address) resolves to; none if it does not."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        logger.debug("spark_torch: executor host %r does not resolve (%s); it is not trusted", host, exc)
        return set()
    return {normalize_address(str(info[4][0])) for info in infos}


def _executor_names(spark: Any) -> set[str]:
    """The hosts of the executors (and the driver) the scheduler knows, as Spark names them."""
    if is_connect_session(spark):
        return set()
    try:
        return {str(info.host()) for info in spark.sparkContext._jsc.sc().statusTracker().getExecutorInfos()}
    except Exception as exc:  # noqa: BLE001 - the channel then treats every node as a stranger
        logger.debug("spark_torch: could not list the executors (%s); no channel address is trusted", exc)
        return set()


def executor_hosts(spark: Any) -> set[str]:
    """IP addresses of the executors Spark knows now (the driver's own included), host names
    resolved, plus loopback on a ``local``/``local-cluster`` master: the addresses the run's
    nodes connect from, whose handshakes the channel keeps apart from strangers'. An executor
    that registers later (dynamic allocation) is not in it; a Spark Connect client cannot ask
    the scheduler, so on a remote cluster it gets an empty set (every node shares the
    strangers' slots)."""
    hosts: set[str] = set()
    for name in _executor_names(spark):
        hosts |= _addresses(name)
    if re.fullmatch(r"local(\[.*\])?|local-cluster\[.*\]", master_of(spark).strip()):
        hosts |= LOOPBACK
    return hosts
