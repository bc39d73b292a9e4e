"""Fail fast when the barrier stage cannot get all its task slots at once.

Spark retries a barrier stage that needs more slots than exist for about ten minutes (40 x 15
s) before failing; :func:`check_slots` asks first (:func:`~spark_torch.driver.spark.cluster.available_slots`)
and, on a cluster master whose executors may still be registering, waits up to the
``executor_wait`` setting.
"""

from __future__ import annotations

import time
from typing import Any

from spark_torch.driver.spark.cluster import (
    available_slots,
    is_connect_session,
    is_local_master,
    master_of,
    session_conf,
    slots_from_conf,
)
from spark_torch.errors import InsufficientSlotsError

__all__ = ["check_slots", "wait_for_slots", "settled_slots", "can_wait", "RANKS_PER_TASK_FIX"]

#: how often the slot count is asked again while executors register
POLL_SECONDS = 0.25
#: the fix that keeps every rank on CPU: fewer, fuller tasks
RANKS_PER_TASK_FIX = (
    "on CPU run several ranks in each task (ranks_per_task=K, a divisor of num_processes: num_processes/K slots)"
)


def can_wait(spark: Any) -> bool:
    """Whether executors can come and go (a cluster master); ``local[N]`` and a Spark Connect
    client's configuration never change while the session lives."""
    return not is_connect_session(spark) and not is_local_master(master_of(spark))


def wait_for_slots(spark: Any, wanted: int, wait: float) -> int | None:
    """The slots there are once ``wanted`` exist, or after ``wait`` seconds (None: unknown)."""
    slots = available_slots(spark)
    if slots is None or slots >= wanted or not can_wait(spark):
        return slots
    deadline = time.monotonic() + wait
    while slots is not None and slots < wanted and time.monotonic() < deadline:
        time.sleep(POLL_SECONDS)
        slots = available_slots(spark)
    return slots


def settled_slots(spark: Any, wait: float) -> int | None:
    """The slots there are once the executors the configuration asks for registered
    (``local-cluster[N,C,M]``, a static ``spark.executor.instances``), waiting up to ``wait``
    seconds on a cluster master; at once where the configuration does not say how many."""
    configured = slots_from_conf(lambda key: session_conf(spark, key))
    return wait_for_slots(spark, configured, wait) if configured else available_slots(spark)


def check_slots(spark: Any, needed: int, executor_wait: float) -> None:
    """Return when ``needed`` slots exist (waiting up to ``executor_wait`` on a cluster master:
    executors of a fresh cluster register over a few seconds, cold JVMs 20-40 s); else raise
    :class:`InsufficientSlotsError` naming the cluster, the numbers and the fixes."""
    slots = wait_for_slots(spark, needed, executor_wait)
    if slots is None or slots >= needed:
        return
    raise InsufficientSlotsError(
        f"distributed mode needs {needed} Spark task slots at once (one barrier task per node), "
        f"but the cluster ({master_of(spark)}) has {slots}. Use num_processes<={slots} (or more GPUs per "
        f"task), {RANKS_PER_TASK_FIX}, add executors/cores, lower spark.task.cpus, or use local_mode=True"
    )
