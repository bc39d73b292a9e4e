"""GPU mapping with Spark's fake GPU discovery (resources exist, CUDA does not)."""

from __future__ import annotations

import os
from typing import Any

import pytest

from spark_torch import ConfigurationError, Distributor


def visible_devices() -> dict[str, Any]:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://")
    mine = {
        k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "NODE_RANK", "CUDA_VISIBLE_DEVICES", "LOCAL_WORLD_SIZE")
    }
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
    # Spark's addresses 0,1 are positions in the executors' own CUDA_VISIBLE_DEVICES=4,6
    assert all(r["LOCAL_WORLD_SIZE"] == "2" and r["CUDA_VISIBLE_DEVICES"] == "4,6" for r in ranks)


@pytest.mark.slow
def test_distributed_gpus_must_divide(gpu_cluster_spark: Any) -> None:
    with pytest.raises(
        ConfigurationError, match=r"num_processes=3 is not a multiple of spark\.task\.resource\.gpu\.amount=2"
    ):
        Distributor(num_processes=3, local_mode=False, spark=gpu_cluster_spark).run(visible_devices)


@pytest.mark.slow
def test_local_mode_uses_driver_gpus(gpu_local_spark: Any, no_leftovers: None) -> None:
    out = Distributor(num_processes=2, spark=gpu_local_spark).run(visible_devices)
    assert [r["CUDA_VISIBLE_DEVICES"] for r in out["ranks"]] == ["0,1", "0,1"]
    with pytest.raises(ConfigurationError, match=r"num_processes=3 but the driver has only 2 GPU"):
        Distributor(num_processes=3, use_gpu=True, spark=gpu_local_spark).run(visible_devices)
    # use_gpu=None: more ranks than GPUs trains on CPU (with one line saying so), it does not fail
    out = Distributor(num_processes=3, spark=gpu_local_spark).run(visible_devices)
    assert [r["CUDA_VISIBLE_DEVICES"] for r in out["ranks"]] == ["", "", ""]


def test_use_gpu_true_without_gpus(spark_session: Any) -> None:
    # a local master runs every task in the driver: the driver's GPUs are what counts
    with pytest.raises(
        RuntimeError,
        match=r"local master local\[2\] runs every task in the driver, which has no GPUs: set spark\.driver\.resource\.gpu\.amount",
    ):
        Distributor(num_processes=2, local_mode=False, use_gpu=True, spark=spark_session).run(visible_devices)
    with pytest.raises(ValueError, match=r"set spark\.driver\.resource\.gpu\.amount"):
        Distributor(num_processes=2, use_gpu=True, spark=spark_session).run(visible_devices)


def test_cpu_runs_see_no_gpu(spark_session: Any, no_leftovers: None) -> None:
    """use_gpu=False (or no GPUs) hides every GPU from the ranks, as TorchDistributor does, even
    when the driver or executor had CUDA_VISIBLE_DEVICES set."""
    os.environ["CUDA_VISIBLE_DEVICES"] = "0,1"
    local = Distributor(num_processes=2, use_gpu=False).run(visible_devices)
    assert [r["CUDA_VISIBLE_DEVICES"] for r in local["ranks"]] == ["", ""]
    distributed = Distributor(num_processes=2, local_mode=False, spark=spark_session).run(visible_devices)
    assert [r["CUDA_VISIBLE_DEVICES"] for r in distributed["ranks"]] == ["", ""]


def test_local_mode_finds_gpus_without_spark(
    spark_session: Any, fake_nvidia_smi: str, caplog: pytest.LogCaptureFixture, no_leftovers: None
) -> None:
    """No Spark GPU resources (or no session at all): local mode asks nvidia-smi, not torch."""
    import logging

    with caplog.at_level(logging.INFO, logger="spark_torch"):
        out = Distributor(num_processes=2).run(visible_devices)
    assert [r["CUDA_VISIBLE_DEVICES"] for r in out["ranks"]] == ["0,1", "0,1"]
    assert "local mode on 2 GPU(s) of this machine found by nvidia-smi (0,1)" in caplog.text
    os.environ["CUDA_VISIBLE_DEVICES"] = "3"  # already restricted: that is what the ranks get
    out = Distributor(num_processes=1).run(visible_devices)
    assert out["ranks"][0]["CUDA_VISIBLE_DEVICES"] == "3"
    # use_gpu=True insists on one GPU per rank; use_gpu=None trains on CPU instead, and says so once
    with pytest.raises(ValueError, match=r"num_processes=2 but the driver has only 1 GPU.*or pass use_gpu=False"):
        Distributor(num_processes=2, use_gpu=True).run(visible_devices)
    caplog.clear()
    out = Distributor(num_processes=2).run(visible_devices)
    assert [r["CUDA_VISIBLE_DEVICES"] for r in out["ranks"]] == ["", ""]
    notes = [r.getMessage() for r in caplog.records if "training on CPU" in r.getMessage()]
    assert len(notes) == 1 and "2 ranks but this machine has 1 GPU(s) (3)" in notes[0]
    assert "use_gpu=True" in notes[0] and "use_gpu=False" in notes[0]
    assert Distributor(num_processes=1, use_gpu=False).run(visible_devices)["ranks"][0]["CUDA_VISIBLE_DEVICES"] == ""


@pytest.mark.slow
def test_local_mode_maps_driver_gpus_through_visible_devices(gpu_local_spark: Any, no_leftovers: None) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = "5,7"
    out = Distributor(num_processes=2, spark=gpu_local_spark).run(visible_devices)
    assert [r["CUDA_VISIBLE_DEVICES"] for r in out["ranks"]] == ["5,7", "5,7"]


@pytest.mark.slow
def test_distributed_on_a_local_master_splits_the_driver_gpus(gpu_local_spark: Any, no_leftovers: None) -> None:
    """local[2] on a 2-GPU machine, local_mode=False: each node gets its own GPU (Spark does not
    schedule task GPUs on a local master), not every rank cuda:0."""
    out = Distributor(num_processes=2, local_mode=False, spark=gpu_local_spark).run(visible_devices)
    assert [(r["NODE_RANK"], r["CUDA_VISIBLE_DEVICES"]) for r in out["ranks"]] == [("0", "0"), ("1", "1")]
    with pytest.raises(RuntimeError, match=r"num_processes=3 but the driver has only 2 GPU"):
        Distributor(num_processes=3, local_mode=False, use_gpu=True, spark=gpu_local_spark).run(visible_devices)
