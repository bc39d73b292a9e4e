"""Training on a DataFrame: spark_torch's run_on_dataframe + rank_loader vs PySpark's
TorchDistributor._train_on_dataframe + its partition loader, on the same Parquet data.

Two tables are written to Parquet once, then read back by both methods: ``array`` (``features``
array<float>[32] + ``label``) and ``scalar`` (16 double columns + ``label``), ``--rows`` rows
each. ``label`` is the row's id, so every rank counts the rows it trained on into a vector of
``rows`` counters that is all-reduced at the end: "exactly once" means every counter is 1.

Both run the same DDP body (``Linear(width, 1)`` in float32, gloo, SGD, batch 1024, one pass)
with 2 ranks, distributed mode on ``local[2]``, one method after the other, ``--reps`` times,
after one warm-up run of each on 20,000 rows.
Reported per method and table: prep s (work before training, none for either here), train s
(the run call, end to end), total s, loop rows/s (rows of both ranks / the slowest rank's
time from the first batch to the last step), the count check, and the peak RSS of the
largest rank (MB).
PySpark's path needs one partition per rank (its docs: "ensure the input Spark DataFrame have
evenly distributed partitions"), so it gets ``repartition(2)``, inside its timed call, and
``num_samples`` = rows // 2; spark_torch takes the DataFrame as read.

    SPARK_LOCAL_IP=127.0.0.1 .venv/bin/python benchmarks/bench_dataframe.py [--rows N] [--reps K] [--tables array,scalar]

Results: benchmarks/results/dataframe.json and benchmarks/README.md. Petastorm and Mosaic
Streaming are not in this script yet: they need side environments (see benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterable
from typing import Any

BATCH = 1024
SCALARS = 16


def ddp_loop(batches: Iterable[tuple[Any, Any]], total: int, width: int) -> dict[str, Any]:
    """The body both methods run: DDP on (x, label) batches, counting every row it trains on."""
    import resource

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://")
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(width, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    seen = torch.zeros(total, dtype=torch.int32)
    rows = 0
    start = time.perf_counter()
    for x, label in batches:
        ids = label.long()
        loss = torch.nn.functional.mse_loss(model(x.float()).squeeze(1), (label.float() / total))
        opt.zero_grad()
        loss.backward()
        opt.step()
        seen.index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
        rows += len(ids)
    stats = torch.tensor([time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, rows], dtype=torch.float64)
    dist.all_reduce(seen)
    dist.all_reduce(stats[:2], op=dist.ReduceOp.MAX)
    rows_all = torch.tensor([rows])
    dist.all_reduce(rows_all)
    out = {
        "loop_s": float(stats[0]), "peak_rss_mb": float(stats[1]), "rows_trained": int(rows_all),
        "missing": int((seen == 0).sum()), "repeated": int((seen > 1).sum()),
    }  # fmt: skip
    dist.destroy_process_group()
    return out


def ours_fn(total: int, table: str) -> dict[str, Any]:
    import torch

    from spark_torch.data import rank_loader

    if table == "array":
        batches: Iterable[Any] = rank_loader(batch_size=BATCH, shuffle=True, seed=0)
        return ddp_loop(batches, total, 32)
    loader = rank_loader(batch_size=BATCH, shuffle=True, seed=0)
    return ddp_loop(((torch.stack(b[:-1], dim=1), b[-1]) for b in loader), total, SCALARS)


def pyspark_fn(total: int, table: str, num_samples: int) -> dict[str, Any]:
    import torch
    from pyspark.ml.torch.distributor import _get_spark_partition_data_loader

    loader = _get_spark_partition_data_loader(num_samples, BATCH, num_workers=0)
    if table == "array":
        return ddp_loop(((b[0], b[1]) for b in loader), total, 32)
    return ddp_loop(((torch.stack(b[:-1], dim=1), b[-1]) for b in loader), total, SCALARS)


def write_tables(spark: Any, rows: int, where: str) -> dict[str, str]:
    from pyspark.sql import functions as F

    base = spark.range(rows, numPartitions=8)
    paths = {"array": os.path.join(where, "array"), "scalar": os.path.join(where, "scalar")}
    base.select(
        F.array(*[F.rand(seed=i).cast("float") for i in range(32)]).alias("features"), F.col("id").cast("double").alias("label")
    ).write.parquet(paths["array"])
    base.select(*[F.rand(seed=i).alias(f"f{i}") for i in range(SCALARS)], F.col("id").cast("double").alias("label")).write.parquet(
        paths["scalar"]
    )
    return paths


def run_once(spark: Any, method: str, table: str, path: str, rows: int, limit: int | None = None) -> dict[str, Any]:
    """One timed run; ``limit``: only that many rows (the warm-up)."""
    from pyspark.ml.torch.distributor import TorchDistributor

    from spark_torch import Distributor

    start = time.perf_counter()
    df = spark.read.parquet(path) if limit is None else spark.read.parquet(path).limit(limit)
    if method == "spark_torch":
        columns = ["features", "label"] if table == "array" else [*[f"f{i}" for i in range(SCALARS)], "label"]
        out = Distributor(num_processes=2, local_mode=False, spark=spark, log_ranks=[]).run_on_dataframe(
            ours_fn, df, rows, table, columns=columns
        )
    else:
        out = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False)._train_on_dataframe(
            pyspark_fn, df.repartition(2), rows, table, (limit or rows) // 2
        )
    train = time.perf_counter() - start
    out.update({"prep_s": 0.0, "train_s": train, "total_s": train, "loop_rows_per_s": out["rows_trained"] / out["loop_s"]})
    out["exactly_once"] = out["missing"] == 0 and out["repeated"] == 0
    return out


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "prep_s": round(statistics.median(r["prep_s"] for r in runs), 2),
        "train_s": round(statistics.median(r["train_s"] for r in runs), 2),
        "total_s": round(statistics.median(r["total_s"] for r in runs), 2),
        "loop_rows_per_s": round(statistics.median(r["loop_rows_per_s"] for r in runs)),
        "rows": "exactly once" if all(r["exactly_once"] for r in runs) else
        f"{max(r['missing'] for r in runs)} missing, {max(r['repeated'] for r in runs)} repeated",
        "peak_rss_mb_per_rank": round(max(r["peak_rss_mb"] for r in runs)),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--tables", default="array,scalar")
    args = parser.parse_args()
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ["PYSPARK_PYTHON"] = sys.executable
    import pyspark
    import torch
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master("local[2]").config("spark.driver.host", "127.0.0.1")
             .config("spark.ui.showConsoleProgress", "false").config("spark.driver.memory", "4g").getOrCreate())  # fmt: skip
    spark.sparkContext.setLogLevel("ERROR")
    where = tempfile.mkdtemp(prefix="bench_dataframe_")
    results: dict[str, Any] = {}
    try:
        paths = write_tables(spark, args.rows, where)
        for method in ("spark_torch", "pyspark"):  # warm-up: the JVM, Python workers, imports
            run_once(spark, method, "scalar", paths["scalar"], args.rows, limit=20_000)
        for table in args.tables.split(","):
            runs: dict[str, list[dict[str, Any]]] = {"spark_torch": [], "pyspark": []}
            for _ in range(args.reps):
                for method in runs:  # interleaved
                    runs[method].append(run_once(spark, method, table, paths[table], args.rows))
                    print(table, method, json.dumps(runs[method][-1]), flush=True)
            summary = {method: summarise(r) for method, r in runs.items()}
            ours, theirs = summary["spark_torch"], summary["pyspark"]
            summary["ratios"] = {
                "loop_rows_per_s": round(ours["loop_rows_per_s"] / theirs["loop_rows_per_s"], 2),
                "total_speedup": round(theirs["total_s"] / ours["total_s"], 2),
                "peak_rss": round(ours["peak_rss_mb_per_rank"] / theirs["peak_rss_mb_per_rank"], 2),
            }
            results[table] = summary
    finally:
        shutil.rmtree(where, ignore_errors=True)
        spark.stop()
    results["config"] = {
        "rows": args.rows, "reps": args.reps, "batch": BATCH, "ranks": 2, "master": "local[2]",
        "python": platform.python_version(), "cpus": os.cpu_count(), "pyspark": pyspark.__version__,
        "torch": torch.__version__,
    }  # fmt: skip
    print(json.dumps(results, indent=2))
    os.makedirs(os.path.join(os.path.dirname(__file__), "results"), exist_ok=True)
    with open(os.path.join(os.path.dirname(__file__), "results", "dataframe.json"), "w") as fh:
        json.dump(results, fh, indent=2)


if __name__ == "__main__":
    main()
