"""One timed run of a peer's DataFrame path, in that peer's side venv (benchmarks/peers/setup.sh).

``bench_dataframe.py`` (the project's venv) writes the Parquet tables once and runs this script
with the peer's venv python for every timed run; this script starts its own SparkSession on
``local[2]`` (PySpark 3.5), does one untimed warm-up on ``--warmup`` rows of the same table, then
the timed run, and writes one JSON object to ``--out``:

* ``petastorm``: prep = ``make_spark_converter(df)`` (Petastorm writes the DataFrame to its Parquet
  cache); train = ``TorchDistributor(2, local_mode=False).run`` of a body that reads
  ``converter.make_torch_dataloader(batch_size, cur_shard=RANK, shard_count=WORLD_SIZE)`` with
  Petastorm's defaults (its reader's thread pool, ``num_epochs=None``) for
  ``len(converter) // (batch * world)`` steps, Databricks' documented pattern (ranks stop at the
  same step, so DDP cannot hang on a rank with one batch more).
* ``streaming``: prep = ``streaming.base.converters.dataframe_to_mds(df)`` (MDS shards, index
  merged); train = ``TorchDistributor`` running ``StreamingDataset(local=..., shuffle=True)`` +
  ``torch.utils.data.DataLoader(batch_size)``. Every TorchDistributor rank has ``LOCAL_RANK=0``,
  so the body sets ``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` from ``RANK``/``WORLD_SIZE`` (both ranks are
  on this host; otherwise they collide on Mosaic's shared-memory prefix) and starts the process
  group before the dataset (which would start and destroy one of its own otherwise).

Both bodies end in ``bench_dataframe.ddp_loop`` (shipped by value), so the DDP step, the batch
size and the per-row count are those of the other methods.

    PEER_VENV/bin/python benchmarks/peers/peer_run.py petastorm --table array --path P --rows N --out OUT.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from typing import Any, cast

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench_dataframe  # noqa: E402  (benchmarks/ is not a package)
from bench_dataframe import BATCH, SCALARS, ddp_loop  # noqa: E402


def _pairs(batches: Iterable[dict[str, Any]], table: str) -> Iterator[tuple[Any, Any]]:
    """(x, label) from a peer's dict batches: the array column, or the scalar columns stacked."""
    import torch

    for b in batches:
        x = b["features"] if table == "array" else torch.stack([b[f"f{i}"] for i in range(SCALARS)], dim=1)
        yield x, b["label"]


def petastorm_fn(converter: Any, total: int, table: str, steps: int) -> dict[str, Any]:
    """A rank: Petastorm's torch DataLoader on this rank's shard, ``steps`` batches."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    with converter.make_torch_dataloader(batch_size=BATCH, cur_shard=rank, shard_count=world) as loader:
        it = iter(loader)
        return ddp_loop(_pairs((next(it) for _ in range(steps)), table), total, 32 if table == "array" else SCALARS)


def streaming_fn(local: str, total: int, table: str) -> dict[str, Any]:
    """A rank: Mosaic's StreamingDataset over the MDS shards + a torch DataLoader."""
    os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"] = os.environ["RANK"], os.environ["WORLD_SIZE"]
    import torch.distributed as dist
    from streaming import StreamingDataset
    from torch.utils.data import DataLoader

    # StreamingDataset starts (and destroys) a process group of its own when none is up; the DDP
    # group started after it on the same store met the first one's stale addresses (gloo: connection
    # refused), so the group is up first, as Mosaic's docs have it
    dist.init_process_group("gloo", init_method="env://")

    dataset = StreamingDataset(local=local, shuffle=True, shuffle_seed=0, batch_size=BATCH)
    loader = DataLoader(dataset, batch_size=BATCH, num_workers=0)
    return ddp_loop(_pairs(loader, table), total, 32 if table == "array" else SCALARS)


def run_petastorm(spark: Any, df: Any, work: str, total: int, table: str) -> tuple[float, float, dict[str, Any]]:
    """Prep and train seconds and the rank-0 result of one Petastorm run."""
    from petastorm.spark import SparkDatasetConverter, make_spark_converter
    from pyspark.ml.torch.distributor import TorchDistributor

    spark.conf.set(SparkDatasetConverter.PARENT_CACHE_DIR_URL_CONF, "file://" + os.path.join(work, "petastorm_cache"))
    start = time.perf_counter()
    converter = make_spark_converter(df)
    prep = time.perf_counter() - start
    steps = len(converter) // (BATCH * 2)
    start, called = time.perf_counter(), time.time()
    try:
        out = cast(
            dict[str, Any],
            TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(
                petastorm_fn, converter, total, table, steps
            ),
        )
        train = time.perf_counter() - start
    finally:
        converter.delete()
    return prep, train, {**out, "train_called_at": called, "train_ended_at": called + train}


def run_streaming(spark: Any, df: Any, work: str, total: int, table: str) -> tuple[float, float, dict[str, Any]]:
    """Prep and train seconds and the rank-0 result of one Mosaic Streaming run."""
    from pyspark.ml.torch.distributor import TorchDistributor
    from streaming.base.converters import dataframe_to_mds
    from streaming.base.util import clean_stale_shared_memory

    local = tempfile.mkdtemp(prefix="mds_", dir=work)
    shutil.rmtree(local)  # dataframe_to_mds wants to make it
    clean_stale_shared_memory()
    start = time.perf_counter()
    dataframe_to_mds(df, merge_index=True, mds_kwargs={"out": local})
    prep = time.perf_counter() - start
    start, called = time.perf_counter(), time.time()
    try:
        out = cast(
            dict[str, Any],
            TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(streaming_fn, local, total, table),
        )
        train = time.perf_counter() - start
    finally:
        shutil.rmtree(local, ignore_errors=True)
    return prep, train, {**out, "train_called_at": called, "train_ended_at": called + train}


RUNNERS = {"petastorm": run_petastorm, "streaming": run_streaming}


def versions(peer: str) -> dict[str, str]:
    """The side venv's versions that matter to the comparison."""
    import numpy
    import pyarrow
    import pyspark
    import torch

    if peer == "petastorm":
        import petastorm as module
    else:
        import streaming as module
    return {
        peer: str(module.__version__),
        "pyspark": pyspark.__version__,
        "pyarrow": pyarrow.__version__,
        "numpy": numpy.__version__,
        "torch": torch.__version__,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("peer", choices=sorted(RUNNERS))
    parser.add_argument("--table", required=True, choices=["array", "scalar"])
    parser.add_argument("--path", required=True, help="the table's Parquet folder")
    parser.add_argument("--rows", type=int, required=True, help="rows in the table (the counter's size)")
    parser.add_argument("--warmup", type=int, default=20_000, help="rows of the untimed warm-up run (0: none)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    from pyspark import cloudpickle
    from pyspark.sql import SparkSession

    cloudpickle.register_pickle_by_value(bench_dataframe)  # type: ignore[no-untyped-call]  # the ranks cannot import benchmarks/
    spark = (
        SparkSession.builder.master("local[2]")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.memory", "4g")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    work = tempfile.mkdtemp(prefix=f"bench_{args.peer}_")
    run = RUNNERS[args.peer]
    try:
        if args.warmup:
            # two partitions: Petastorm needs at least as many row groups as shards
            run(spark, spark.read.parquet(args.path).limit(args.warmup).repartition(2), work, args.rows, args.table)
        prep, train, out = run(spark, spark.read.parquet(args.path), work, args.rows, args.table)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        spark.stop()
    out.update({"prep_s": prep, "train_s": train, "total_s": prep + train, "versions": versions(args.peer)})
    with open(args.out, "w") as fh:
        json.dump(out, fh)


if __name__ == "__main__":
    main()
