"""DataFrame shards keep DDP in step: skewed Spark partitions still give every rank the same
number of rows and batches (a rank with one batch more would leave DDP's all-reduce waiting)."""

from __future__ import annotations

from typing import Any

import pytest

from spark_torch import Distributor
from spark_torch.rank.data import rank_positions


@pytest.mark.parametrize("local_world", [1, 2, 3])
@pytest.mark.parametrize("drop_last", [False, True])
def test_rank_positions_exhaustive(local_world: int, drop_last: bool) -> None:
    """Every rank the same count; drop_last=False uses every row; drop_last=True never repeats."""
    for a in range(1, 9):
        for b in range(0, 9):
            rows_per_node = [a, b] if b else [a]
            if any(r < local_world for r in rows_per_node):
                continue
            shares = [
                rank_positions(rows, j, local_world, rows_per_node, drop_last)
                for rows in rows_per_node
                for j in range(local_world)
            ]
            assert len({len(s) for s in shares}) == 1, (rows_per_node, shares)
            node_shares = [shares[n * local_world : (n + 1) * local_world] for n in range(len(rows_per_node))]
            for rows, mine in zip(rows_per_node, node_shares):
                used = [p for share in mine for p in share]
                assert all(0 <= p < rows for p in used)
                if drop_last:
                    assert len(used) == len(set(used))
                else:
                    assert set(used) == set(range(rows))


def skewed_df(spark: Any, rows: int = 101, partitions: int = 3) -> Any:
    """``rows`` rows in ``partitions`` partitions of very different sizes."""
    from pyspark.sql import functions as F

    df = (
        spark.range(rows)
        .withColumn("x", F.col("id").cast("double") / 10)
        .withColumn("y", F.col("id").cast("double") % 7)
    )
    # partition p gets ids with p == 0 for most rows: a few partitions hold nearly everything
    return df.repartition(partitions, (F.col("id") % 10 == 0).cast("int"))


def ddp_epochs(batch_size: int, num_workers: int, drop_last: bool) -> dict[str, Any]:
    """DDP with an all-reduce per batch (inside backward), two epochs; returns per-rank counts."""
    import torch
    import torch.distributed as dist

    from spark_torch.data import rank_loader

    dist.init_process_group("gloo", init_method="env://")
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1).double())
    opt = torch.optim.SGD(model.parameters(), lr=0.001)
    loader = rank_loader(
        batch_size, columns=["x", "y", "id"], drop_last=drop_last, num_workers=num_workers, shuffle=True
    )
    counts = []
    seen: list[int] = []
    for _ in range(2):
        batches = 0
        for x, y, ids in loader:
            loss = torch.nn.functional.mse_loss(model(x.unsqueeze(1)).squeeze(1), y)
            opt.zero_grad()
            loss.backward()  # DDP all-reduces the gradients here
            opt.step()
            batches += 1
            seen += ids.tolist()
        counts.append(batches)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"batches": counts, "ids": seen})
    dist.destroy_process_group()
    return {"ranks": gathered}


def _check(out: dict[str, Any], rows: int, drop_last: bool) -> None:
    ranks = out["ranks"]
    assert len({tuple(r["batches"]) for r in ranks}) == 1, [r["batches"] for r in ranks]
    ids = [i for r in ranks for i in r["ids"]]
    if not drop_last:
        assert set(ids) == set(range(rows))


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("drop_last", [False, True])
def test_local_mode_ddp_on_skewed_partitions(
    spark_session: Any, num_workers: int, drop_last: bool, no_leftovers: None
) -> None:
    """101 rows for 3 ranks in batches of 3: 34, 34 and 33 rows would be 12, 12 and 11 batches."""
    df = skewed_df(spark_session)
    out = Distributor(num_processes=3, timeout=120).run_on_dataframe(ddp_epochs, df, 3, num_workers, drop_last)
    _check(out, 101, drop_last)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_distributed_ddp_on_skewed_partitions(spark_session: Any, num_workers: int, no_leftovers: None) -> None:
    """101 rows in 3 skewed partitions (90, 11, 0) over 2 nodes: repartition(2) gives the nodes
    50 and 51 rows (5 and 6 batches of 10); the ranks still run the same number of batches."""
    df = skewed_df(spark_session)
    out = Distributor(num_processes=2, local_mode=False, spark=spark_session, timeout=120).run_on_dataframe(
        ddp_epochs, df, 10, num_workers, False
    )
    _check(out, 101, False)


def test_distributed_ddp_two_ranks_per_node(spark_session: Any, no_leftovers: None) -> None:
    """103 rows, nodes of 51 and 52, 2 ranks each: 26/25 and 26/26 rows (6 or 5 batches of 5)."""
    df = skewed_df(spark_session, rows=103, partitions=5)
    out = Distributor(
        num_processes=4, local_mode=False, spark=spark_session, ranks_per_task=2, timeout=120
    ).run_on_dataframe(ddp_epochs, df, 5, 0, False)
    _check(out, 103, False)
