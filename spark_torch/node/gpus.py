"""GPU arithmetic (pure): how many ranks a task hosts and which GPUs each rank sees; and
finding this machine's GPUs without importing torch (for local mode without Spark's resources).
"""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
from collections.abc import Callable, Mapping, Sequence

from spark_torch.base import envnames
from spark_torch.errors import ClusterConfigurationError

__all__ = [
    "ranks_per_task",
    "local_gpu_addresses",
    "spark_order",
    "visible_devices",
    "through_visible",
    "detect_local_gpus",
    "node_gpus",
]

logger = logging.getLogger(__name__)

#: seconds nvidia-smi may take before it counts as absent
NVIDIA_SMI_SECONDS = 10.0
_GPU_LINE = re.compile(r"^GPU (\d+):", re.M)


def ranks_per_task(task_gpu_amount: float, num_processes: int) -> int:
    """Ranks per barrier task with GPUs: one per GPU Spark gives each task.

    ``spark.task.resource.gpu.amount`` must be a whole number that divides ``num_processes``.
    """
    if task_gpu_amount < 1 or task_gpu_amount != int(task_gpu_amount):
        raise ClusterConfigurationError(
            f"spark.task.resource.gpu.amount={task_gpu_amount:g} is not a whole number of GPUs; "
            "spark_torch runs one rank per GPU of a task, so set it to 1 (one rank per task) "
            "or to the number of GPUs each executor should drive, or pass use_gpu=False to train on CPU"
        )
    per_task = int(task_gpu_amount)
    if num_processes % per_task:
        raise ClusterConfigurationError(
            f"num_processes={num_processes} is not a multiple of spark.task.resource.gpu.amount="
            f"{per_task}: each barrier task runs {per_task} ranks (one per GPU), so use "
            f"num_processes={max(per_task, num_processes - num_processes % per_task)}, change "
            "spark.task.resource.gpu.amount, or pass use_gpu=False to train on CPU"
        )
    return per_task


def spark_order(addresses: Sequence[str]) -> tuple[str, ...]:
    """Spark's GPU addresses in a stable numeric-looking order ("2" before "10")."""
    return tuple(sorted(addresses, key=lambda a: (len(a), a)))


def local_gpu_addresses(addresses: tuple[str, ...], num_processes: int) -> tuple[str, ...]:
    """The driver machine's GPUs a run uses: the first ``num_processes``, in the given order."""
    if num_processes > len(addresses):
        raise ClusterConfigurationError(
            f"num_processes={num_processes} but the driver has only {len(addresses)} GPU(s) "
            f"({', '.join(addresses) or 'none'}); use num_processes<={len(addresses)}, raise "
            "spark.driver.resource.gpu.amount, or pass use_gpu=False to train on CPU"
        )
    return tuple(addresses[:num_processes])


def visible_devices(addresses: tuple[str, ...]) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` value for a set of GPU addresses."""
    return ",".join(addresses)


def through_visible(addresses: Sequence[str], visible: str | None) -> tuple[str, ...]:
    """Spark's GPU addresses as this process's CUDA sees them.

    When ``CUDA_VISIBLE_DEVICES`` is already set where the ranks start, Spark's addresses index
    into it (TorchDistributor's convention: "0" is the first visible GPU); otherwise they are
    used as they are.
    """
    if not visible or not visible.strip():
        return tuple(addresses)
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    mapped = []
    for address in addresses:
        if not address.isdigit() or int(address) >= len(entries):
            raise ClusterConfigurationError(
                f"Spark assigned GPU {address!r}, but CUDA_VISIBLE_DEVICES={visible!r} is already set "
                f"where the ranks start and has {len(entries)} entr{'y' if len(entries) == 1 else 'ies'}; "
                "Spark's GPU addresses are taken as positions in it. Unset CUDA_VISIBLE_DEVICES on the "
                "executors (or driver), or make the discovery script report positions in it"
            )
        mapped.append(entries[int(address)])
    return tuple(mapped)


def detect_local_gpus(
    environ: Mapping[str, str], run: Callable[..., subprocess.CompletedProcess[str]] = subprocess.run
) -> tuple[tuple[str, ...], str]:
    """This machine's GPUs without importing torch: ``(addresses, how they were found)``.

    ``CUDA_VISIBLE_DEVICES`` when set (its entries; empty or ``-1`` means none), else the GPUs
    ``nvidia-smi -L`` lists; ``((), "")`` when neither says anything.
    """
    visible = environ.get(envnames.CUDA_VISIBLE_DEVICES)
    if visible is not None:
        entries = tuple(e.strip() for e in visible.split(",") if e.strip())
        if not entries or entries[0] == "-1":
            return (), envnames.CUDA_VISIBLE_DEVICES
        return entries, envnames.CUDA_VISIBLE_DEVICES
    smi = shutil.which("nvidia-smi", path=environ.get("PATH"))
    if smi is None:
        return (), ""
    try:
        done = run([smi, "-L"], capture_output=True, text=True, timeout=NVIDIA_SMI_SECONDS)
    except (OSError, subprocess.TimeoutExpired) as exc:
        logger.warning("spark_torch: nvidia-smi -L failed (%s); local mode treats this machine as having no GPU", exc)
        return (), ""
    if done.returncode != 0:
        return (), ""
    return tuple(_GPU_LINE.findall(done.stdout)), "nvidia-smi"


def node_gpus(all_gpus: Sequence[str], node_rank: int, per_node: int) -> tuple[str, ...]:
    """Distributed mode on a local master: node ``node_rank``'s share of the driver's GPUs."""
    return tuple(all_gpus[node_rank * per_node : (node_rank + 1) * per_node])
