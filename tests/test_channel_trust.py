"""The driver's channel trusts the executors Spark knows (their handshakes wait in slots a flood
of strangers cannot take: ``tests/reliability/test_channel_flood.py``): which addresses those are,
read from a real Spark session."""

from __future__ import annotations

from typing import Any

from spark_torch import Distributor
from spark_torch.driver.spark.cluster import _addresses, _executor_names, executor_hosts


def _rank() -> int:
    import os

    return int(os.environ["RANK"])


def test_every_executor_of_a_local_cluster_is_listed_and_trusted(cluster_spark: Any) -> None:
    """local-cluster[2,1,1024] on 127.0.0.1: the scheduler lists the driver and both executors,
    and their address (and loopback, a local master) is trusted."""
    infos = cluster_spark.sparkContext._jsc.sc().statusTracker().getExecutorInfos()
    assert len(infos) == 3, [str(i.host()) for i in infos]
    names = _executor_names(cluster_spark)
    assert "127.0.0.1" in names and names <= {"127.0.0.1", "localhost"}, names  # the driver may say localhost
    assert executor_hosts(cluster_spark) == {"127.0.0.1", "::1"}


def test_a_local_master_trusts_loopback(plain_local_spark: Any) -> None:
    assert {"127.0.0.1", "::1"} <= executor_hosts(plain_local_spark)


def test_host_names_are_resolved_and_unknown_names_trust_nothing() -> None:
    assert "127.0.0.1" in _addresses("localhost")
    assert _addresses("::ffff:127.0.0.1") == {"127.0.0.1"}
    assert _addresses("no-such-host.invalid") == set()


def test_a_distributed_run_gives_its_channel_the_executors_addresses(
    cluster_spark: Any, channels: list[Any], no_leftovers: None
) -> None:
    opened = channels
    assert Distributor(num_processes=2, local_mode=False, spark=cluster_spark).run(_rank) == 0
    assert len(opened) == 1
    assert opened[0]._server._slots.trusted == {"127.0.0.1", "::1"}
