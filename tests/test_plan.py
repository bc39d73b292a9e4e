"""Unit tests of the pure planning, validation, env and GPU logic (no Spark)."""

from __future__ import annotations

import pytest

from spark_torch import ConfigurationError, Distributor
from spark_torch.cluster import ClusterInfo
from spark_torch.config import DistributorConfig
from spark_torch.env import RankIdentity, rank_env
from spark_torch.gpus import local_gpu_addresses, ranks_per_task
from spark_torch.plan import make_plan


@pytest.mark.parametrize("bad", [True, False, 1.0, "2", None])
def test_num_processes_must_be_int(bad: object) -> None:
    with pytest.raises(TypeError, match=r"num_processes must be an int >= 1, got"):
        Distributor(num_processes=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [0, -1])
def test_num_processes_must_be_positive(bad: int) -> None:
    with pytest.raises(ValueError, match=rf"num_processes must be >= 1, got {bad}"):
        Distributor(num_processes=bad)


def test_reserved_env_rejected() -> None:
    with pytest.raises(ValueError, match="env may not set RANK"):
        Distributor(env={"RANK": "3"})


def test_bad_timeout_and_log_ranks() -> None:
    with pytest.raises(ValueError, match="timeout must be > 0"):
        Distributor(timeout=0)
    with pytest.raises(ValueError, match="log_ranks must be"):
        Distributor(log_ranks="some")


def test_local_plan_cpu() -> None:
    plan = make_plan(DistributorConfig(num_processes=4), ClusterInfo(), cpu_count=8)
    assert (plan.num_nodes, plan.procs_per_node, plan.world_size, plan.use_gpu) == (1, 4, 4, False)
    assert plan.threads_per_rank == 2


def test_distributed_plan_cpu_one_rank_per_task() -> None:
    cluster = ClusterInfo(task_cpus=4)
    plan = make_plan(DistributorConfig(num_processes=3, local_mode=False), cluster)
    assert (plan.num_nodes, plan.procs_per_node, plan.threads_per_rank) == (3, 1, 4)


def test_distributed_plan_gpu_ranks_per_task() -> None:
    cluster = ClusterInfo(task_gpu_amount=2, executor_gpu_amount=4)
    plan = make_plan(DistributorConfig(num_processes=4, local_mode=False), cluster)
    assert plan.use_gpu and (plan.num_nodes, plan.procs_per_node) == (2, 2)
    cpu = make_plan(DistributorConfig(num_processes=4, local_mode=False, use_gpu=False), cluster)
    assert not cpu.use_gpu and (cpu.num_nodes, cpu.procs_per_node) == (4, 1)


def test_use_gpu_true_without_gpus_names_the_key() -> None:
    with pytest.raises(ValueError, match=r"spark\.task\.resource\.gpu\.amount"):
        make_plan(DistributorConfig(num_processes=2, local_mode=False, use_gpu=True), ClusterInfo())
    with pytest.raises(ValueError, match=r"spark\.driver\.resource\.gpu\.amount"):
        make_plan(DistributorConfig(num_processes=2, local_mode=True, use_gpu=True), ClusterInfo())


def test_gpus_per_task_must_divide() -> None:
    with pytest.raises(ValueError, match=r"num_processes=3 is not a multiple of spark\.task\.resource\.gpu\.amount=2"):
        ranks_per_task(2, 3)
    with pytest.raises(ValueError, match="not a whole number"):
        ranks_per_task(0.5, 2)


def test_local_gpus_deterministic_and_bounded() -> None:
    assert local_gpu_addresses(("10", "2", "1", "0"), 3) == ("0", "1", "2")
    with pytest.raises(ValueError, match=r"num_processes=3 but the driver has only 2 GPU"):
        local_gpu_addresses(("0", "1"), 3)


def test_local_plan_gpu() -> None:
    cluster = ClusterInfo(driver_gpu_amount=2, driver_gpu_addresses=("1", "0"))
    plan = make_plan(DistributorConfig(num_processes=2), cluster)
    assert plan.use_gpu and plan.local_gpus == ("0", "1")


def test_ssl_refused_unless_ignored() -> None:
    config = DistributorConfig(num_processes=2, local_mode=False)
    with pytest.raises(ConfigurationError, match=r"pytorch\.spark\.distributor\.ignoreSsl=true"):
        make_plan(config, ClusterInfo(ssl_enabled=True))
    assert make_plan(config, ClusterInfo(ssl_enabled=True, ignore_ssl=True)).num_nodes == 2


def test_rank_env_contract() -> None:
    base = {"PATH": "/bin", "OMP_NUM_THREADS": "1", "PYSPARK_GATEWAY_SECRET": "s3cret"}
    env = rank_env(
        base,
        RankIdentity(rank=3, local_rank=1, world_size=4, local_world_size=2, node_rank=1, num_nodes=2),
        master_addr="10.0.0.1",
        master_port=29500,
        run_id="abc",
        threads=3,
        cuda_visible_devices="2,3",
        extra={"NCCL_SOCKET_IFNAME": "eth0"},
    )
    assert env["RANK"] == "3" and env["LOCAL_RANK"] == "1" and env["WORLD_SIZE"] == "4"
    assert env["LOCAL_WORLD_SIZE"] == "2" and env["NODE_RANK"] == env["GROUP_RANK"] == "1"
    assert env["MASTER_ADDR"] == "10.0.0.1" and env["MASTER_PORT"] == "29500"
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3" and env["OMP_NUM_THREADS"] == "3"
    assert env["NCCL_SOCKET_IFNAME"] == "eth0" and env["PATH"] == "/bin"
    assert "PYSPARK_GATEWAY_SECRET" not in env
    assert base["OMP_NUM_THREADS"] == "1"  # the input is not modified


def test_ranks_per_task_cpu() -> None:
    config = DistributorConfig(num_processes=4, local_mode=False, ranks_per_task=2)
    plan = make_plan(config, ClusterInfo(task_cpus=4))
    assert (plan.num_nodes, plan.procs_per_node, plan.threads_per_rank) == (2, 2, 2)
    with pytest.raises(ValueError, match=r"num_processes=3 is not a multiple of ranks_per_task=2"):
        DistributorConfig(num_processes=3, local_mode=False, ranks_per_task=2)
    with pytest.raises(ValueError, match="ranks_per_task applies to distributed mode"):
        DistributorConfig(num_processes=2, ranks_per_task=2)
    with pytest.raises(ValueError, match=r"ranks_per_task=1 but each task has 2 GPU"):
        make_plan(DistributorConfig(num_processes=4, local_mode=False, ranks_per_task=1), ClusterInfo(task_gpu_amount=2))
