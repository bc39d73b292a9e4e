"""Turn options + cluster facts into a launch plan. Pure: every mode/device branch lives here."""

from __future__ import annotations

import os
from dataclasses import dataclass

from . import gpus
from .cluster import IGNORE_SSL_KEY, ClusterInfo
from .config import DistributorConfig
from .errors import ConfigurationError

__all__ = ["LaunchPlan", "make_plan"]


@dataclass(frozen=True)
class LaunchPlan:
    """How a run is laid out: nodes (Spark tasks, or the driver), ranks per node, devices."""

    local_mode: bool
    num_nodes: int
    procs_per_node: int
    use_gpu: bool
    #: local mode only: the driver GPUs, one per rank, in rank order
    local_gpus: tuple[str, ...] = ()
    #: OMP/MKL threads per rank (Spark sets OMP_NUM_THREADS=1 for Python tasks)
    threads_per_rank: int = 1

    @property
    def world_size(self) -> int:
        """Total number of ranks."""
        return self.num_nodes * self.procs_per_node


def _resolve_use_gpu(config: DistributorConfig, cluster: ClusterInfo) -> bool:
    if config.local_mode:
        has_gpus = cluster.driver_gpu_amount > 0 and bool(cluster.driver_gpu_addresses)
        key = "spark.driver.resource.gpu.amount"
        where = "the driver"
    else:
        has_gpus = cluster.task_gpu_amount > 0
        key = "spark.task.resource.gpu.amount"
        where = "each barrier task"
    if config.use_gpu is None:
        return has_gpus
    if config.use_gpu and not has_gpus:
        raise ConfigurationError(
            f"use_gpu=True but Spark gives {where} no GPUs: set {key} (with "
            f"{'spark.driver.resource.gpu.discoveryScript' if config.local_mode else 'spark.executor.resource.gpu.amount'}"
            ") when creating the SparkSession, or pass use_gpu=False to train on CPU"
        )
    return config.use_gpu


def make_plan(config: DistributorConfig, cluster: ClusterInfo, cpu_count: int | None = None) -> LaunchPlan:
    """Plan a run, or raise :class:`ConfigurationError` saying what to change."""
    if cluster.ssl_enabled and not cluster.ignore_ssl and not config.local_mode:
        raise ConfigurationError(
            "this Spark cluster requires encryption (spark.ssl.enabled or "
            "spark.network.crypto.enabled), but torch's gloo/NCCL traffic between ranks is not "
            f"encrypted. If the network between executors is trusted, set {IGNORE_SSL_KEY}=true "
            "in the Spark conf to run anyway"
        )
    use_gpu = _resolve_use_gpu(config, cluster)
    n = config.num_processes
    if config.local_mode:
        local_gpus = gpus.local_gpu_addresses(cluster.driver_gpu_addresses, n) if use_gpu else ()
        cpus = cpu_count if cpu_count is not None else (os.cpu_count() or 1)
        return LaunchPlan(
            local_mode=True,
            num_nodes=1,
            procs_per_node=n,
            use_gpu=use_gpu,
            local_gpus=local_gpus,
            threads_per_rank=max(1, cpus // n),
        )
    if use_gpu:
        per_task = gpus.ranks_per_task(cluster.task_gpu_amount, n)
        if config.ranks_per_task is not None and config.ranks_per_task != per_task:
            raise ConfigurationError(
                f"ranks_per_task={config.ranks_per_task} but each task has {per_task} GPU(s) "
                "(spark.task.resource.gpu.amount) and runs one rank per GPU; drop ranks_per_task "
                "or change spark.task.resource.gpu.amount"
            )
    else:
        # CPU: one rank per task unless asked; the task's spark.task.cpus are shared by its ranks
        per_task = config.ranks_per_task or 1
    if n % per_task:  # pragma: no cover - ranks_per_task already checked
        raise ConfigurationError(f"num_processes={n} is not a multiple of {per_task}")
    return LaunchPlan(
        local_mode=False,
        num_nodes=n // per_task,
        procs_per_node=per_task,
        use_gpu=use_gpu,
        threads_per_rank=max(1, cluster.task_cpus // per_task),
    )
