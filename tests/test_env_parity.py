"""The rank environment matches torchrun's where users rely on it: NCCL async error handling,
a per-rank TORCHELASTIC_ERROR_FILE whose content becomes the error's traceback, thread counts
that respect what the user or the cluster chose."""

from __future__ import annotations

import os

import pytest

from spark_torch import DistributedRunError, Distributor
from spark_torch.driver.cluster import ClusterInfo
from spark_torch.driver.config import DistributorConfig
from spark_torch.driver.plan import make_plan

from .conftest import SCRIPTS


def _env(*keys: str) -> dict[str, str | None]:
    return {k: os.environ.get(k) for k in keys}


KEYS = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCHELASTIC_ERROR_FILE", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "RANK")


def test_torchrun_variables(no_leftovers: None) -> None:
    os.environ.pop("OMP_NUM_THREADS", None)
    ranks = [Distributor(num_processes=2).run(_env, *KEYS)]
    env = ranks[0]
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert env["TORCHELASTIC_ERROR_FILE"] and env["TORCHELASTIC_ERROR_FILE"].endswith("rank-0.torchelastic-error.json")
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == str(max(1, len(os.sched_getaffinity(0)) // 2))


def test_user_choices_win(no_leftovers: None) -> None:
    os.environ["OMP_NUM_THREADS"] = "3"  # exported on the driver: local-mode ranks keep it
    env = Distributor(num_processes=2, env={"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}).run(_env, *KEYS)
    assert env["OMP_NUM_THREADS"] == "3" and env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"
    env = Distributor(num_processes=2, env={"OMP_NUM_THREADS": "5"}).run(_env, *KEYS)
    assert env["OMP_NUM_THREADS"] == "5"


def test_cluster_thread_setting_is_kept() -> None:
    config = DistributorConfig(num_processes=2, local_mode=False)
    assert make_plan(config, ClusterInfo(task_cpus=4)).threads_per_rank == 4
    assert make_plan(config, ClusterInfo(task_cpus=4, executor_threads="8")).threads_per_rank is None


def test_record_error_file_becomes_the_traceback(no_leftovers: None) -> None:
    """A script using torch's @record fails on rank 1: the error names the exception and shows
    the traceback @record wrote, as torchrun's error summary would."""
    with pytest.raises(DistributedRunError) as info:
        Distributor(num_processes=2).run(str(SCRIPTS / "elastic_record.py"))
    message = str(info.value)
    assert message.startswith("rank 1 on ") and "failed: ValueError: shard 1 is corrupt" in message.splitlines()[0]
    assert "Traceback from rank 1" in message and "in load_shard" in message
