"""Unit tests of the pure planning, validation, env and GPU logic (no Spark)."""

from __future__ import annotations

import os
from typing import Any

import pytest

from spark_torch import ConfigurationError, Distributor
from spark_torch.driver.config import DistributorConfig
from spark_torch.driver.run.plan import make_plan
from spark_torch.driver.spark.cluster import ClusterInfo
from spark_torch.node.gpus import local_gpu_addresses, ranks_per_task
from spark_torch.node.rank_env import RankIdentity, rank_env


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


def test_a_replica_groups_ranks_share_the_cores_with_every_group() -> None:
    """Local mode: each rank gets the driver's cores over every group's ranks (torchrun's share),
    not over its own group's; a thread count exported on the driver is kept."""
    from spark_torch.driver.api.replica_groups import group_config
    from spark_torch.driver.run.plan import HostFacts

    whole = DistributorConfig(num_processes=4, replica_groups=2)
    group = group_config(whole, 1, "http://127.0.0.1:1", "run")
    assert group.num_processes == 2 and group.host_ranks == 4
    assert make_plan(group, ClusterInfo(), cpu_count=8).threads_per_rank == 2  # 8 cores / 4 ranks, not / 2
    assert make_plan(group, ClusterInfo(), cpu_count=2).threads_per_rank == 1
    assert make_plan(group, ClusterInfo(), cpu_count=8, host=HostFacts(omp_threads="3")).threads_per_rank is None


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
    from spark_torch.node.gpus import spark_order

    assert local_gpu_addresses(spark_order(("10", "2", "1", "0")), 3) == ("0", "1", "2")
    assert local_gpu_addresses(("3", "1"), 2) == ("3", "1")  # a CUDA_VISIBLE_DEVICES order is kept
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
    # Spark's RPC encryption alone runs, as with TorchDistributor (the channel is encrypted itself)
    assert make_plan(config, ClusterInfo(crypto_enabled=True)).num_nodes == 2


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
        make_plan(
            DistributorConfig(num_processes=4, local_mode=False, ranks_per_task=1), ClusterInfo(task_gpu_amount=2)
        )


def _endpoint(cluster: ClusterInfo, env: dict[str, str]) -> Any:
    """The channel endpoint as a run resolves it: settings from ``env`` and the cluster's conf."""
    from spark_torch.driver.run.endpoints import resolve_endpoint
    from spark_torch.settings import resolve

    return resolve_endpoint(cluster, resolve({}, env, cluster.torch_conf))


def test_endpoint_resolution() -> None:

    classic = ClusterInfo(driver_host="10.0.0.5")
    assert _endpoint(classic, {}) == _endpoint(classic, {}).__class__(bind_host="10.0.0.5", advertise_host="10.0.0.5")
    bound = ClusterInfo(driver_host="driver.svc", driver_bind_address="0.0.0.0")
    e = _endpoint(bound, {"SPARK_TORCH_CHANNEL_PORTS": "40000-40100", "SPARK_TORCH_RENDEZVOUS_TIMEOUT": "5"})
    assert (e.bind_host, e.advertise_host, e.ports, e.rendezvous_timeout) == (
        "0.0.0.0",
        "driver.svc",
        (40000, 40100),
        5.0,
    )
    # the override applies in every mode; host:port is for NAT / port mapping
    e = _endpoint(bound, {"SPARK_TORCH_CHANNEL_HOST": "203.0.113.9:31000"})
    assert (e.bind_host, e.advertise_host, e.advertise_port) == ("0.0.0.0", "203.0.113.9", 31000)
    e = _endpoint(ClusterInfo(), {"SPARK_TORCH_CHANNEL_HOST": "[::1]:5"})
    assert (e.advertise_host, e.advertise_port, e.bind_host) == ("::1", 5, "127.0.0.1")
    e = _endpoint(ClusterInfo(), {"SPARK_TORCH_CHANNEL_HOST": "::1", "SPARK_TORCH_CHANNEL_BIND_ADDRESS": "::1"})
    assert (e.advertise_host, e.bind_host) == ("::1", "::1")
    assert _endpoint(ClusterInfo(), {"SPARK_TORCH_CHANNEL_HOST": "fe80::1"}).advertise_host == "fe80::1"
    # Spark conf keys when no environment variable is set
    conf = ClusterInfo(torch_conf={"spark.torch.channel.ports": "41000", "spark.torch.rendezvous.timeout": "7.5"})
    e = _endpoint(conf, {})
    assert (e.ports, e.rendezvous_timeout) == ((41000, 41000), 7.5)
    # a Connect client advertises the interface that routes to the Connect server, not 127.0.1.1
    connect = ClusterInfo(is_connect=True, connect_host="127.0.0.1", driver_bind_address="10.9.9.9")
    assert _endpoint(connect, {}).advertise_host == "127.0.0.1"
    assert _endpoint(connect, {}).bind_host == "127.0.0.1"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"SPARK_TORCH_CHANNEL_PORTS": "40100-40000"}, "SPARK_TORCH_CHANNEL_PORTS='40100-40000' is not a port range"),
        ({"SPARK_TORCH_CHANNEL_PORTS": "many"}, "SPARK_TORCH_CHANNEL_PORTS='many' is not a port range"),
        ({"SPARK_TORCH_RENDEZVOUS_TIMEOUT": "0"}, "SPARK_TORCH_RENDEZVOUS_TIMEOUT='0' must be a number of seconds > 0"),
        ({"SPARK_TORCH_CHANNEL_HOST": ""}, "SPARK_TORCH_CHANNEL_HOST is empty"),
        ({"SPARK_TORCH_CHANNEL_HOST": "host:1-2"}, "give one port after the host"),
        ({"SPARK_TORCH_HEARTBEAT": "-1"}, "SPARK_TORCH_HEARTBEAT='-1' must be"),
    ],
)
def test_endpoint_errors(env: dict[str, str], message: str) -> None:
    from spark_torch import ConfigurationError
    from spark_torch.driver.spark.cluster import ClusterInfo

    with pytest.raises(ConfigurationError) as info:
        _endpoint(ClusterInfo(), env)
    assert message in str(info.value)


def test_a_replica_groups_rank_gets_torchfts_logs_at_warn_unless_the_user_chose() -> None:
    """RUST_LOG=warn for a replica group's rank only, and only when neither the node's
    environment (the driver's in local mode, the executor's) nor ``env=`` set it."""
    who = RankIdentity(rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0, num_nodes=1)
    group = {"REPLICA_GROUP_ID": "1", "NUM_REPLICA_GROUPS": "2", "TORCHFT_LIGHTHOUSE": "http://127.0.0.1:1"}

    def env(base: dict[str, str], extra: dict[str, str]) -> dict[str, str]:
        return rank_env(base, who, master_addr="127.0.0.1", master_port=1, run_id="r", extra=extra)

    assert env({}, group)["RUST_LOG"] == "warn"
    assert env({"RUST_LOG": "info"}, group)["RUST_LOG"] == "info"
    assert env({}, {**group, "RUST_LOG": "torchft=debug"})["RUST_LOG"] == "torchft=debug"
    assert "RUST_LOG" not in env({}, {})  # not a replica group's rank: untouched


def test_rank_env_scrubs_spark_secrets() -> None:
    from spark_torch.node.rank_env import RankIdentity, rank_env

    base = {
        "_SPARK_AUTH_SECRET": "x",
        "PYTHON_WORKER_FACTORY_SECRET": "y",
        "SPARK_CONNECT_AUTHENTICATE_TOKEN": "z",
        "HOME": "/h",
    }
    env = rank_env(base, RankIdentity(0, 0, 1, 1, 0, 1), master_addr="h", master_port=1, run_id="r")
    assert "HOME" in env and not {
        "_SPARK_AUTH_SECRET",
        "PYTHON_WORKER_FACTORY_SECRET",
        "SPARK_CONNECT_AUTHENTICATE_TOKEN",
    } & set(env)


def test_numpy_integers_are_accepted_as_counts() -> None:
    import numpy as np

    config = DistributorConfig(
        num_processes=np.int64(4), local_mode=False, max_restarts=np.int32(1), ranks_per_task=np.int16(2)
    )
    assert (config.num_processes, config.max_restarts, config.ranks_per_task) == (4, 1, 2)
    assert all(type(v) is int for v in (config.num_processes, config.max_restarts, config.ranks_per_task))
    with pytest.raises(TypeError, match="num_processes must be an int"):
        DistributorConfig(num_processes=np.float64(2.0))


def test_gpu_and_tls_misconfiguration_is_also_a_runtime_error() -> None:
    """TorchDistributor raises RuntimeError for these; ``except RuntimeError`` keeps working."""
    from spark_torch import ClusterConfigurationError

    with pytest.raises(ClusterConfigurationError) as info:
        make_plan(DistributorConfig(num_processes=2, local_mode=False, use_gpu=True), ClusterInfo())
    assert isinstance(info.value, RuntimeError) and isinstance(info.value, ValueError)
    with pytest.raises(RuntimeError, match="requires encryption"):
        make_plan(DistributorConfig(num_processes=2, local_mode=False), ClusterInfo(ssl_enabled=True))


@pytest.mark.parametrize(
    ("conf", "slots"),
    [
        ({"spark.master": "local[4]"}, 4),
        ({"spark.master": "local[4]", "spark.task.cpus": "2"}, 2),
        ({"spark.master": "local"}, 1),
        ({"spark.master": "local[*]"}, None),
        ({"spark.master": "local-cluster[2,3,1024]"}, 6),
        (
            {
                "spark.master": "spark://h:7077",
                "spark.executor.instances": "3",
                "spark.executor.cores": "4",
                "spark.task.cpus": "2",
            },
            6,
        ),
        (
            {
                "spark.master": "yarn",
                "spark.executor.instances": "3",
                "spark.executor.cores": "4",
                "spark.dynamicAllocation.enabled": "true",
            },
            None,
        ),
        ({"spark.master": "k8s://h"}, None),
    ],
)
def test_slots_from_conf(conf: dict[str, str], slots: int | None) -> None:
    from spark_torch.driver.spark.cluster import slots_from_conf

    assert slots_from_conf(conf.get) == slots


def test_cgroup_quota() -> None:
    from spark_torch.driver.run.cpus import available_cpus, quota_cpus

    assert quota_cpus("max 100000") is None and quota_cpus("150000 100000") == 2 and quota_cpus("50000 100000") == 1
    assert quota_cpus(None, "-1", "100000") is None and quota_cpus(None, "400000", "100000") == 4
    assert 1 <= available_cpus() <= (os.cpu_count() or 1)


def test_python_versions_compare_major_minor() -> None:
    """PySpark's rule: the same major.minor everywhere; a patch difference only warns."""
    from spark_torch.node.lifecycle import python_mismatch

    assert python_mismatch("3.11.9", ["3.11.9", "3.11.9"]) == (None, None)
    error, warning = python_mismatch("3.11.9", ["3.11.4", "3.11.9"])
    assert error is None and warning is not None and "3.11.4, 3.11.9" in warning
    error, warning = python_mismatch("3.11.9", ["3.10.12"])
    assert error is not None and "set PYSPARK_PYTHON" in error and warning is None


def test_ipv6_hosts_lose_their_brackets_for_binding() -> None:
    """Spark reports IPv6 task addresses as [addr]:port; bind() wants the bare address."""
    from spark_torch.node.lifecycle import host_of
    from spark_torch.node.processes import reserve_port

    assert host_of("10.0.0.5:41234") == "10.0.0.5" and host_of("worker-3:7") == "worker-3"
    host = host_of("[::1]:41234")
    assert host == "::1"
    try:
        sock = reserve_port(host)
    except OSError:
        pytest.skip("no IPv6 loopback here")
    assert sock.getsockname()[0] == "::1"
    sock.close()


@pytest.mark.parametrize(
    ("version", "ok"), [("3.4.1", False), ("3.3.2", False), ("3.5.0", True), ("4.1.1", True), ("4.3.0.dev0", True)]
)
def test_supported_pyspark_versions(version: str, ok: bool) -> None:
    from spark_torch.driver.spark.pyspark_shims import check_pyspark

    if ok:
        check_pyspark(version)
    else:
        with pytest.raises(
            ConfigurationError,
            match=rf"needs PySpark 3.5 or 4.x .* this driver has PySpark {version}\. Upgrade pyspark",
        ):
            check_pyspark(version)


def test_pyspark_34_fails_before_anything_starts() -> None:
    """A driver whose pyspark says 3.4 (older Databricks LTS): one clear error, no session started."""
    import subprocess
    import sys
    import time

    code = (
        "import pyspark; pyspark.__version__ = '3.4.1'\n"
        "from spark_torch import Distributor\n"
        "try:\n"
        "    Distributor(num_processes=2, local_mode=False).run(print)\n"
        "except ValueError as exc:\n"
        "    print(type(exc).__name__, exc)\n"
        "from pyspark import SparkContext\n"
        "print('session started:', SparkContext._active_spark_context is not None)\n"
    )
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "ConfigurationError distributed mode needs PySpark 3.5 or 4.x" in done.stdout, done.stdout + done.stderr
    assert "this driver has PySpark 3.4.1" in done.stdout and "session started: False" in done.stdout
    assert time.monotonic() - start < 30


@pytest.mark.parametrize(
    ("cluster", "warns"),
    [
        (ClusterInfo(master="local"), False),
        (ClusterInfo(master="local[4]"), False),
        (ClusterInfo(master="local[*, 2]"), False),
        (ClusterInfo(master="local-cluster[2,1,1024]"), True),
        (ClusterInfo(master="spark://h:7077"), True),
        (ClusterInfo(master="yarn"), True),
        (ClusterInfo(master="spark://h:7077", crypto_enabled=True), False),
        (ClusterInfo(master="k8s://h", rpc_ssl_enabled=True), False),
    ],
)
def test_a_cluster_without_rpc_encryption_is_warned(cluster: ClusterInfo, warns: bool) -> None:
    from spark_torch.driver.spark.cluster import unencrypted_rpc_warning

    warning = unencrypted_rpc_warning(cluster)
    assert (warning is not None) == warns, (cluster.master, warning)
    assert warning is None or "spark.network.crypto.enabled=true" in warning


@pytest.mark.parametrize(
    "cluster",
    [
        ClusterInfo(master="local[2]"),
        ClusterInfo(master="spark://h:7077"),  # RPC in clear: both warn
        ClusterInfo(master="spark://h:7077", crypto_enabled=True),
        ClusterInfo(master="k8s://h", rpc_ssl_enabled=True),
        ClusterInfo(master="spark://h:7077", ssl_enabled=True),  # refused by both
        ClusterInfo(master="spark://h:7077", ssl_enabled=True, ignore_ssl=True, crypto_enabled=True),
    ],
    ids=["local", "rpc-off", "rpc-on", "rpc-ssl", "tls", "tls-ignored"],
)
def test_doctor_and_run_agree_on_the_checks_they_share(cluster: ClusterInfo, caplog: pytest.LogCaptureFixture) -> None:
    """One table (driver/spark/checks.py): what a distributed run logs as a warning is a ``warn``
    row of doctor with the fix, what it refuses a ``FAIL`` row, and doctor's ``ok`` rows are
    silent in a run (doctor once showed "RPC encryption off" as ok while every run warned)."""
    import logging

    from spark_torch.cli.doctor import format_table, shared_rows
    from spark_torch.driver.run.controller import _plan
    from spark_torch.errors import ClusterConfigurationError

    rows = shared_rows(cluster)
    config = DistributorConfig(num_processes=2, local_mode=False, use_gpu=False)
    with caplog.at_level(logging.WARNING, logger="spark_torch"):
        try:
            _plan(config, cluster)
            refused = None
        except ClusterConfigurationError as exc:
            refused = str(exc)
    warned = [r.getMessage() for r in caplog.records]
    failed = [row for row in rows if not row.ok]
    assert (refused is not None) == bool(failed), (refused, rows)
    if refused is None:
        assert len(warned) == len([row for row in rows if row.warn]), (warned, rows)
    table = format_table(rows).splitlines()
    marks = [line[:4] for line in table if not line.startswith(" ")]
    assert marks == ["FAIL" if not row.ok else "warn" if row.warn else "ok  " for row in rows]
    assert all(any(line.strip() == f"fix: {row.fix}" for line in table) for row in rows if row.warn or not row.ok)


def test_rpc_encryption_off_on_a_cluster_is_a_warning_in_doctor() -> None:
    from spark_torch.cli.doctor import shared_rows

    rpc = next(
        row for row in shared_rows(ClusterInfo(master="spark://h:7077")) if row.name.startswith("RPC encryption")
    )
    assert (rpc.value, rpc.ok, rpc.warn) == ("off", True, True)
    assert rpc.fix == "set spark.authenticate=true and spark.network.crypto.enabled=true"
