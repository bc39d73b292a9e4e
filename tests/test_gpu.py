"""GPU mapping with Spark's fake GPU discovery (resources exist, CUDA does not)."""

from __future__ import annotations

import os
from typing import Any

import pytest

from spark_torch import ConfigurationError, Distributor


def visible_devices() -> dict[str, Any]:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://")
    mine = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "NODE_RANK", "CUDA_VISIBLE_DEVICES", "LOCAL_WORLD_SIZE")}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    dist.destroy_process_group()
    return {"ranks": gathered}


@pytest.mark.slow
def test_distributed_ranks_per_task_follow_gpus(gpu_cluster_spark: Any, no_leftovers: None) -> None:
    out = Distributor(num_processes=4, local_mode=False, spark=gpu_cluster_spark).run(visible_devices)
    ranks = out["ranks"]
    assert [r["RANK"] for r in ranks] == ["0", "1", "2", "3"]
    assert [r["NODE_RANK"] for r in ranks] == ["0", "0", "1", "1"]
    assert [r["LOCAL_RANK"] for r in ranks] == ["0", "1", "0", "1"]
    assert all(r["LOCAL_WORLD_SIZE"] == "2" and r["CUDA_VISIBLE_DEVICES"] == "0,1" for r in ranks)


@pytest.mark.slow
def test_distributed_gpus_must_divide(gpu_cluster_spark: Any) -> None:
    with pytest.raises(ConfigurationError, match=r"num_processes=3 is not a multiple of spark\.task\.resource\.gpu\.amount=2"):
        Distributor(num_processes=3, local_mode=False, spark=gpu_cluster_spark).run(visible_devices)


@pytest.mark.slow
def test_local_mode_uses_driver_gpus(gpu_local_spark: Any, no_leftovers: None) -> None:
    out = Distributor(num_processes=2, spark=gpu_local_spark).run(visible_devices)
    assert [r["CUDA_VISIBLE_DEVICES"] for r in out["ranks"]] == ["0,1", "0,1"]
    with pytest.raises(ConfigurationError, match=r"num_processes=3 but the driver has only 2 GPU"):
        Distributor(num_processes=3, spark=gpu_local_spark).run(visible_devices)


def test_use_gpu_true_without_gpus(spark_session: Any) -> None:
    with pytest.raises(ValueError, match=r"set spark\.task\.resource\.gpu\.amount"):
        Distributor(num_processes=2, local_mode=False, use_gpu=True, spark=spark_session).run(visible_devices)
    with pytest.raises(ValueError, match=r"set spark\.driver\.resource\.gpu\.amount"):
        Distributor(num_processes=2, use_gpu=True, spark=spark_session).run(visible_devices)
