"""How many CPUs this process may really use: its affinity mask and its cgroup's CPU quota.

``os.cpu_count()`` counts the machine; a container or a ``taskset`` sees fewer. Used to give
each local-mode rank its share of threads.
"""

from __future__ import annotations

import math
import os

__all__ = ["available_cpus", "quota_cpus"]

#: cgroup v2 (``cpu.max``) and v1 (``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``) files
_V2_MAX = "/sys/fs/cgroup/cpu.max"
_V1_QUOTA = "/sys/fs/cgroup/cpu/cpu.cfs_quota_us"
_V1_PERIOD = "/sys/fs/cgroup/cpu/cpu.cfs_period_us"


def quota_cpus(cpu_max: str | None = None, v1_quota: str | None = None, v1_period: str | None = None) -> int | None:
    """CPUs allowed by a cgroup quota, rounded up; None when unlimited or unknown.

    Takes the files' contents (pure): ``cpu_max`` is cgroup v2's ``"max 100000"`` or
    ``"150000 100000"``; ``v1_quota``/``v1_period`` are cgroup v1's (quota ``-1`` = none).
    """
    if cpu_max is not None:
        parts = cpu_max.split()
        if len(parts) == 2 and parts[0] != "max":
            try:
                return max(1, math.ceil(int(parts[0]) / int(parts[1])))
            except (ValueError, ZeroDivisionError):
                return None
        return None
    if v1_quota is not None and v1_period is not None:
        try:
            quota, period = int(v1_quota), int(v1_period)
        except ValueError:
            return None
        if quota > 0 and period > 0:
            return max(1, math.ceil(quota / period))
    return None


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii") as fh:
            return fh.read().strip()
    except OSError:
        return None


def available_cpus() -> int:
    """min(CPUs in this process's affinity mask, its cgroup quota), at least 1."""
    try:
        count = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        count = os.cpu_count() or 1
    quota = (
        quota_cpus(_read(_V2_MAX)) if os.path.exists(_V2_MAX) else quota_cpus(None, _read(_V1_QUOTA), _read(_V1_PERIOD))
    )
    return max(1, min(count, quota) if quota else count)
