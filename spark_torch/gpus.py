"""Pure GPU arithmetic: how many ranks a task hosts and which GPUs each rank sees."""

from __future__ import annotations

from .errors import ConfigurationError

__all__ = ["ranks_per_task", "local_gpu_addresses", "visible_devices"]


def ranks_per_task(task_gpu_amount: float, num_processes: int) -> int:
    """Ranks per barrier task with GPUs: one per GPU Spark gives each task.

    ``spark.task.resource.gpu.amount`` must be a whole number that divides ``num_processes``.
    """
    if task_gpu_amount < 1 or task_gpu_amount != int(task_gpu_amount):
        raise ConfigurationError(
            f"spark.task.resource.gpu.amount={task_gpu_amount:g} is not a whole number of GPUs; "
            "spark_torch runs one rank per GPU of a task, so set it to 1 (one rank per task) "
            "or to the number of GPUs each executor should drive"
        )
    per_task = int(task_gpu_amount)
    if num_processes % per_task:
        raise ConfigurationError(
            f"num_processes={num_processes} is not a multiple of spark.task.resource.gpu.amount="
            f"{per_task}: each barrier task runs {per_task} ranks (one per GPU), so use "
            f"num_processes={max(per_task, num_processes - num_processes % per_task)} or change "
            "spark.task.resource.gpu.amount"
        )
    return per_task


def local_gpu_addresses(addresses: tuple[str, ...], num_processes: int) -> tuple[str, ...]:
    """The driver GPUs used in local mode: the first ``num_processes`` in a stable order."""
    ordered = tuple(sorted(addresses, key=lambda a: (len(a), a)))
    if num_processes > len(ordered):
        raise ConfigurationError(
            f"num_processes={num_processes} but the driver has only {len(ordered)} GPU(s) "
            f"({', '.join(ordered) or 'none'}); use num_processes<={len(ordered)} or raise "
            "spark.driver.resource.gpu.amount"
        )
    return ordered[:num_processes]


def visible_devices(addresses: tuple[str, ...]) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` value for a set of GPU addresses."""
    return ",".join(addresses)
