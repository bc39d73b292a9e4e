"""First vs later runs of ``run_on_dataframe(..., reuse_staged=True)`` (docs/dataframe.md).

Like Petastorm's cache is measured (the epoch that fills the cache against the ones that read
it): ``--rows`` rows of ``features`` array<float>[32] + ``label`` are written to Parquet once,
then trained on by 2 ranks in distributed mode on ``local[2]`` (one epoch, batch 1024, shuffled,
a DDP ``Linear`` step per batch, every row counted): twice without ``reuse_staged`` (the first
warms the session up: Python workers, the shipped package, the warm-start template; the second
is the baseline, where every run reads and stages), then ``--runs`` times with it (the first
stages and keeps, the others reuse). Each run's end-to-end seconds and ``last_run.staging``, and the load average
before and after, go to ``benchmarks/results/staged_reuse.json``::

    SPARK_LOCAL_IP=127.0.0.1 .venv/bin/python benchmarks/bench_staged_reuse.py [--rows N] [--runs K]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))


def one_epoch() -> dict[str, Any]:
    """One shuffled epoch with a DDP step per batch; rows of every rank."""
    import torch
    import torch.distributed as dist

    from spark_torch.data import rank_loader

    dist.init_process_group("gloo", init_method="env://")
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.001)
    rows = 0
    for features, label in rank_loader(batch_size=1024, shuffle=True, seed=0, dtype={"label": torch.float32}):
        loss = torch.nn.functional.mse_loss(model(features).squeeze(1), label)
        opt.zero_grad()
        loss.backward()
        opt.step()
        rows += len(label)
    total = torch.tensor([rows])
    dist.all_reduce(total)
    return {"rows": int(total)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "staged_reuse.json"))
    args = parser.parse_args()
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F

    from spark_torch import Distributor

    spark = (
        SparkSession.builder.master("local[2]")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.catalogImplementation", "in-memory")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    load = [os.getloadavg()]
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-staged-reuse-") as where:
        path = os.path.join(where, "array")
        spark.range(0, args.rows, 1, 8).select(
            F.array(*[F.rand(seed=i).cast("float") for i in range(32)]).alias("features"),
            F.col("id").cast("double").alias("label"),
        ).write.parquet(path)
        df = spark.read.parquet(path)
        d = Distributor(num_processes=2, local_mode=False, spark=spark)
        for index, reuse in enumerate([False, False] + [True] * args.runs):
            started = time.perf_counter()
            out = d.run_on_dataframe(one_epoch, df, columns=["features", "label"], reuse_staged=reuse)
            seconds = time.perf_counter() - started
            staging = d.last_run.staging if d.last_run is not None else None
            runs.append(
                {
                    "run": index,
                    "warm_up": index == 0,
                    "reuse_staged": reuse,
                    "staging": str(staging),
                    "seconds": round(seconds, 2),
                    "rows": out["rows"],
                }
            )
            print(json.dumps(runs[-1]), flush=True)
    spark.stop()
    load.append(os.getloadavg())
    result = {
        "rows": args.rows,
        "table": "features array<float>[32] + label, Parquet",
        "ranks": 2,
        "master": "local[2]",
        "runs": runs,
        "load_average": {"start": load[0], "end": load[1]},
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)
    print(json.dumps(result["load_average"]))


if __name__ == "__main__":
    main()
