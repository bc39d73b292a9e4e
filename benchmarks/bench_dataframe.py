"""DataFrame -> batched tensors: spark_torch.run_on_dataframe vs PySpark's _train_on_dataframe.

Same DataFrame (ROWS rows x 32 float columns + a 16-wide Spark ML vector column), 2 ranks,
distributed mode on local[2], batch size 1024, one pass over each rank's rows. Reported:
rows/s inside the training function (loading only) and end-to-end seconds per run, medians
of REPS alternating repetitions, plus the ratio. Peak RSS of rank 0 is reported too.

    SPARK_LOCAL_IP=127.0.0.1 .venv/bin/python benchmarks/bench_dataframe.py [--rows N] [--reps K]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

BATCH = 1024


def ours_fn() -> dict[str, float]:
    import resource

    import torch  # noqa: F401 - both sides import torch before the clock starts

    from spark_torch.data import rank_loader

    start = time.perf_counter()
    rows = 0
    for batch in rank_loader(batch_size=BATCH, columns=["features", "vec"]):
        feats, vec = batch
        rows += len(feats)
    took = time.perf_counter() - start
    return {"rows": rows, "seconds": took, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def pyspark_fn(num_samples: int) -> dict[str, float]:
    import resource

    import torch  # noqa: F401 - both sides import torch before the clock starts
    from pyspark.ml.torch.distributor import _get_spark_partition_data_loader

    start = time.perf_counter()
    rows = 0
    for batch in _get_spark_partition_data_loader(num_samples, BATCH, num_workers=0):
        rows += len(batch[0])
    took = time.perf_counter() - start
    return {"rows": rows, "seconds": took, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args()
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ["PYSPARK_PYTHON"] = sys.executable
    from pyspark.ml.functions import array_to_vector
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F

    spark = (SparkSession.builder.master("local[2]").config("spark.driver.host", "127.0.0.1")
             .config("spark.ui.showConsoleProgress", "false").config("spark.driver.memory", "4g").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    floats = [F.rand(seed=i).cast("float").alias(f"f{i}") for i in range(32)]
    base = spark.range(args.rows, numPartitions=2).select(*floats, array_to_vector(F.array(*[F.rand(seed=100 + i) for i in range(16)])).alias("vec"))
    # PySpark's loader wants numeric columns; both read the same 32 floats + the vector
    ours_df = base.select(F.array(*[f"f{i}" for i in range(32)]).alias("features"), "vec").cache()
    theirs_df = base.select(*[f"f{i}" for i in range(32)], "vec").cache()
    ours_df.count(), theirs_df.count()

    from pyspark.ml.torch.distributor import TorchDistributor

    from spark_torch import Distributor

    per_rank = args.rows // 2
    results: dict[str, list[dict[str, float]]] = {"spark_torch": [], "pyspark": []}
    for _ in range(args.reps):
        t = time.perf_counter()
        out = Distributor(num_processes=2, local_mode=False, spark=spark, log_ranks=[]).run_on_dataframe(ours_fn, ours_df)
        out["end_to_end"] = time.perf_counter() - t
        results["spark_torch"].append(out)
        t = time.perf_counter()
        out = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False)._train_on_dataframe(pyspark_fn, theirs_df, per_rank)
        out["end_to_end"] = time.perf_counter() - t
        results["pyspark"].append(out)
    summary = {}
    for name, runs in results.items():
        summary[name] = {
            "rows_per_s_in_loop": statistics.median(r["rows"] / r["seconds"] for r in runs),
            "end_to_end_s": statistics.median(r["end_to_end"] for r in runs),
            "peak_rss_mb_rank0": max(r["peak_rss_mb"] for r in runs),
            "rows_rank0": runs[0]["rows"],
        }
    summary["ratio_rows_per_s"] = summary["spark_torch"]["rows_per_s_in_loop"] / summary["pyspark"]["rows_per_s_in_loop"]
    summary["ratio_end_to_end"] = summary["pyspark"]["end_to_end_s"] / summary["spark_torch"]["end_to_end_s"]
    summary["config"] = {"rows": args.rows, "reps": args.reps, "batch": BATCH, "python": platform.python_version(), "cpus": os.cpu_count()}
    print(json.dumps(summary, indent=2))
    os.makedirs(os.path.join(os.path.dirname(__file__), "results"), exist_ok=True)
    with open(os.path.join(os.path.dirname(__file__), "results", "dataframe.json"), "w") as fh:
        json.dump(summary, fh, indent=2)
    spark.stop()


if __name__ == "__main__":
    main()
