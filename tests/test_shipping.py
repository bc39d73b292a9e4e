"""The driver ships its spark_torch to the executors: an executor without spark_torch, or with
another version, runs the driver's code; with shipping off the nodes refuse to run mixed code,
naming both versions. On local-cluster, with a real DDP all-reduce."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from spark_torch import Distributor, LaunchError
from spark_torch.version import package_identity

from .conftest import MISSING_FLAG

pytestmark = pytest.mark.slow


def which_spark_torch() -> tuple[str, str, float]:
    """(the identity this rank runs, where it was imported from, a gloo all_reduce of ones)."""
    import torch
    import torch.distributed as dist

    import spark_torch
    from spark_torch.version import package_identity

    dist.init_process_group("gloo", init_method="env://")
    total = torch.ones(1)
    dist.all_reduce(total)
    dist.destroy_process_group()
    return package_identity(), spark_torch.__file__, total.item()


def test_without_shipping_mixed_code_is_refused(stale_executors_spark: tuple[Any, Path], no_leftovers: None) -> None:
    """First in this session: once shipped, the zip stays on the session's Python path."""
    spark, root = stale_executors_spark
    with pytest.raises(LaunchError) as info:
        Distributor(num_processes=2, local_mode=False, spark=spark, ship_package=False).run(which_spark_torch)
    message = str(info.value)
    assert f"the executors run another spark_torch than the driver ({package_identity()}): 0.0.9+" in message
    assert "Leave the ship_package setting on" in message
    (root / MISSING_FLAG).touch()
    try:
        with pytest.raises(LaunchError, match=r"the executors' Python cannot import spark_torch"):
            Distributor(num_processes=2, local_mode=False, spark=spark, ship_package=False).run(which_spark_torch)
    finally:
        (root / MISSING_FLAG).unlink()


@pytest.mark.parametrize("executors", ["without spark_torch", "with spark_torch 0.0.9"])
def test_executors_run_the_drivers_package(
    stale_executors_spark: tuple[Any, Path], executors: str, no_leftovers: None
) -> None:
    spark, root = stale_executors_spark
    flag = root / MISSING_FLAG
    if executors == "without spark_torch":
        flag.touch()
    try:
        identity, where, total = Distributor(num_processes=2, local_mode=False, spark=spark).run(which_spark_torch)
    finally:
        flag.unlink(missing_ok=True)
    assert identity == package_identity() and ".zip/spark_torch/" in where and total == 2.0
