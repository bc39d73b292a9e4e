"""Turn options + cluster facts into a launch plan. Pure: every mode/device branch lives here."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from spark_torch.base import envnames
from spark_torch.base.envnames import CUDA_VISIBLE_DEVICES
from spark_torch.driver.config import DistributorConfig
from spark_torch.driver.run.cpus import available_cpus
from spark_torch.driver.spark.checks import Verdict, tls_check
from spark_torch.driver.spark.cluster import ClusterInfo, is_local_master
from spark_torch.errors import ClusterConfigurationError, ConfigurationError
from spark_torch.node import gpus
from spark_torch.shared.spec import GpuFallback, LaunchPlan

__all__ = ["LaunchPlan", "HostFacts", "host_facts", "make_plan"]


@dataclass(frozen=True)
class HostFacts:
    """What the driver machine itself says (its environment, its GPUs), read by the caller."""

    #: ``OMP_NUM_THREADS`` exported on the driver (local-mode ranks keep it)
    omp_threads: str | None = None
    #: ``CUDA_VISIBLE_DEVICES`` of the driver (Spark's driver GPU addresses index into it)
    cuda_visible: str | None = None
    #: GPUs found on this machine without Spark (``CUDA_VISIBLE_DEVICES`` or ``nvidia-smi``)
    gpus_found: tuple[str, ...] = ()
    gpus_found_by: str = ""


def host_facts(local_mode: bool, use_gpu: bool | None, cluster: ClusterInfo, environ: Mapping[str, str]) -> HostFacts:
    """The driver machine's own facts (for a run with these ``local_mode`` and ``use_gpu``
    options); its GPUs are looked for only when local mode may use them."""
    found: tuple[tuple[str, ...], str] = ((), "")
    spark_gives_gpus = cluster.driver_gpu_amount > 0 and bool(cluster.driver_gpu_addresses)
    if local_mode and use_gpu is not False and not spark_gives_gpus:
        found = gpus.detect_local_gpus(environ)
    return HostFacts(
        omp_threads=environ.get(envnames.THREAD_VARS[0]),
        cuda_visible=environ.get(CUDA_VISIBLE_DEVICES),
        gpus_found=found[0],
        gpus_found_by=found[1],
    )


@dataclass(frozen=True)
class _GpuSource:
    """Where a run's GPUs come from, and what to set when there are none."""

    available: bool
    #: the GPUs themselves when the driver machine runs the ranks (local mode, local master)
    addresses: tuple[str, ...] = ()
    missing_fix: str = ""


def _gpu_source(config: DistributorConfig, cluster: ClusterInfo, host: HostFacts) -> _GpuSource:
    driver_gpus = gpus.spark_order(cluster.driver_gpu_addresses) if cluster.driver_gpu_amount > 0 else ()
    if config.local_mode:
        if driver_gpus:
            return _GpuSource(True, gpus.through_visible(driver_gpus, host.cuda_visible))
        if host.gpus_found:
            return _GpuSource(True, host.gpus_found)
        return _GpuSource(
            False,
            missing_fix="Spark gives the driver no GPUs and none were found on this machine "
            "(CUDA_VISIBLE_DEVICES, nvidia-smi): set spark.driver.resource.gpu.amount (with "
            "spark.driver.resource.gpu.discoveryScript) when creating the SparkSession",
        )
    if is_local_master(cluster.master):
        # Spark does not schedule task GPUs on a local master: the driver's GPUs are split over the nodes
        return _GpuSource(
            bool(driver_gpus),
            gpus.through_visible(driver_gpus, host.cuda_visible) if driver_gpus else (),
            missing_fix=f"the local master {cluster.master} runs every task in the driver, which has no "
            "GPUs: set spark.driver.resource.gpu.amount (with spark.driver.resource.gpu.discoveryScript)",
        )
    return _GpuSource(
        cluster.task_gpu_amount > 0,
        missing_fix="Spark gives each barrier task no GPUs: set spark.task.resource.gpu.amount (with "
        "spark.executor.resource.gpu.amount) when creating the SparkSession",
    )


def _resolve_use_gpu(config: DistributorConfig, source: _GpuSource) -> tuple[bool, GpuFallback | None]:
    """Whether the run uses GPUs, and why not when ``use_gpu=None`` chose CPU although GPUs exist
    (fewer of this machine's GPUs than ranks: a one-GPU laptop running two ranks)."""
    n = config.num_processes
    if config.use_gpu is None:
        if source.available and source.addresses and len(source.addresses) < n:
            return False, GpuFallback(ranks=n, gpus=tuple(source.addresses))
        return source.available, None
    if config.use_gpu and not source.available:
        raise ClusterConfigurationError(f"use_gpu=True but {source.missing_fix}, or pass use_gpu=False to train on CPU")
    return config.use_gpu, None


def make_plan(
    config: DistributorConfig,
    cluster: ClusterInfo,
    cpu_count: int | None = None,
    *,
    host: HostFacts | None = None,
) -> LaunchPlan:
    """Plan a run, or raise :class:`ConfigurationError` saying what to change."""
    host = host or HostFacts()
    tls = tls_check(cluster)  # the check doctor shows too (driver/spark/checks.py)
    if tls.verdict is Verdict.FAIL and not config.local_mode:
        raise ClusterConfigurationError(tls.message)
    source = _gpu_source(config, cluster, host)
    use_gpu, gpu_fallback = _resolve_use_gpu(config, source)
    n = config.num_processes
    if config.local_mode:
        cpus = cpu_count if cpu_count is not None else available_cpus()
        return LaunchPlan(
            local_mode=True,
            num_nodes=1,
            procs_per_node=n,
            use_gpu=use_gpu,
            local_gpus=gpus.local_gpu_addresses(source.addresses, n) if use_gpu else (),
            # a thread count the user exported on the driver is theirs; else each rank on the
            # machine (every replica group's) gets its share of the cores, as torchrun's do
            threads_per_rank=None if host.omp_threads else max(1, cpus // (config.host_ranks or n)),
            gpu_fallback=gpu_fallback,
        )
    if use_gpu and source.addresses:  # a local master: one GPU per rank, nodes share the driver's
        per_task = config.ranks_per_task or 1
        local_gpus = gpus.local_gpu_addresses(source.addresses, n)
    elif use_gpu:
        per_task = gpus.ranks_per_task(cluster.task_gpu_amount, n)
        local_gpus = ()
        if config.ranks_per_task is not None and config.ranks_per_task != per_task:
            raise ClusterConfigurationError(
                f"ranks_per_task={config.ranks_per_task} but each task has {per_task} GPU(s) "
                "(spark.task.resource.gpu.amount) and runs one rank per GPU; drop ranks_per_task "
                "or change spark.task.resource.gpu.amount"
            )
    else:
        # CPU: one rank per task unless asked; the task's spark.task.cpus are shared by its ranks
        per_task = config.ranks_per_task or 1
        local_gpus = ()
    if n % per_task:  # pragma: no cover - ranks_per_task already checked
        raise ConfigurationError(f"num_processes={n} is not a multiple of {per_task}")
    return LaunchPlan(
        local_mode=False,
        num_nodes=n // per_task,
        procs_per_node=per_task,
        use_gpu=use_gpu,
        local_gpus=local_gpus,
        # Spark pins OMP_NUM_THREADS to spark.task.cpus for Python workers unless the cluster
        # set spark.executorEnv.OMP_NUM_THREADS; only Spark's own value is replaced
        threads_per_rank=None if cluster.executor_threads else max(1, cluster.task_cpus // per_task),
        gpu_fallback=gpu_fallback,
    )
