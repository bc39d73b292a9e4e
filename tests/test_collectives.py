"""End-to-end: real torch.distributed (gloo, 2 ranks) programs run through ``Distributor`` on Spark.

One run per program per Spark session keeps the suite fast: ``all_collectives`` does
point-to-point, every collective, a sub-group and a hand-written ring all-reduce in one
process group; ``ddp_training`` trains a tiny MLP under DistributedDataParallel.

The cluster tests request ``cluster_spark`` as a fixture argument (not through
``request.getfixturevalue``) so conftest's ordering hook, which reads ``item.fixturenames``,
runs them after the ``spark_session`` tests.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest

from spark_torch import Distributor

from . import dist_programs

WORLD = 2
#: bound on one run, well under pytest-timeout's 300 s: a hung collective fails, not stalls
RUN_TIMEOUT = 180.0


def _run(spark: Any, fn: Callable[..., Any], *args: Any) -> Any:
    return Distributor(num_processes=WORLD, local_mode=False, spark=spark, timeout=RUN_TIMEOUT).run(fn, *args)


def check_collectives(spark: Any) -> None:
    results = _run(spark, dist_programs.all_collectives)
    assert sorted(results) == [0, 1]
    r0, r1 = results[0], results[1]
    for rank, r in results.items():
        assert r["rank"] == r["env_rank"] == rank
        assert r["world_size"] == r["env_world_size"] == WORLD
        assert r["backend"] == "gloo"

    # point-to-point
    assert r1["send_recv"] == [1, 2, 3]
    assert r1["recv_sender"] == 0
    assert r0["send_recv"] == [2, 4, 6]
    assert r0["isend_irecv"] == [20] * 4  # from rank 1
    assert r1["isend_irecv"] == [10] * 4  # from rank 0

    # collectives
    for r in (r0, r1):
        assert r["broadcast"] == [0, 7, 14, 21]
        assert r["all_reduce_sum"] == [1 + 2, 2 + 3]
        assert r["all_reduce_max"] == [2, 3]
        assert r["all_reduce_product"] == [1 * 2, 2 * 3]
        assert r["all_gather"] == [[5, 5, 5], [6, 6, 6]]
        assert r["barrier"] is True
    assert r0["reduce"] == [1 + 2, 10 + 20]
    assert "reduce" not in r1
    assert r0["scatter"] == [0, 1]
    assert r1["scatter"] == [100, 101]
    assert r0["gather"] == [[0, 0], [1, 1]]

    # sub-groups
    assert r0["solo_group_rank"] == -1
    assert r1["solo_group_rank"] == 0
    assert r1["solo_all_reduce"] == [41]
    assert r1["solo_group_size"] == 1
    assert "solo_all_reduce" not in r0
    for r in (r0, r1):
        assert r["pair_all_reduce_product"] == [3 * 4]
        assert r["pair_group_size"] == WORLD

    # ring all-reduce over send/recv
    expected = [sum(i * (rank + 1) + rank for rank in range(WORLD)) for i in range(10)]
    for r in (r0, r1):
        assert r["ring_all_reduce"] == expected
        assert r["ring_matches_all_reduce"] is True


def check_ddp(spark: Any) -> None:
    result = _run(spark, dist_programs.ddp_training, 5, 0.1)
    checksums = result["checksums"]
    assert len(checksums) == WORLD
    assert all(math.isfinite(c) for c in checksums)
    # replicas end identical (bit for bit: DDP applies the same averaged gradients)
    assert checksums[0] == checksums[1]
    assert result["identical"] is True
    # training moved the weights and reduced rank 0's loss
    assert checksums[0] != result["initial_checksum_rank0"]
    assert result["losses"][-1] < result["losses"][0]
    # DDP on equal shards with a mean loss == single-process full-batch SGD from rank 0's init
    assert math.isclose(checksums[0], result["reference_checksum"], rel_tol=1e-9, abs_tol=1e-9)


CHECKS = pytest.mark.parametrize("check", [check_collectives, check_ddp], ids=["collectives", "ddp"])


@CHECKS
def test_local_spark(spark_session: Any, no_leftovers: None, check: Callable[[Any], None]) -> None:
    """``local[2]``: two barrier tasks in the driver's JVM, each starting one rank."""
    check(spark_session)


@pytest.mark.slow
@CHECKS
def test_local_cluster(cluster_spark: Any, no_leftovers: None, check: Callable[[Any], None]) -> None:
    """``local-cluster[2,1,1024]``: one barrier task, hence one rank, on each executor JVM."""
    check(cluster_spark)
