#!/usr/bin/env python
"""What spark_torch.report() costs the training loop.

    SPARK_LOCAL_IP=127.0.0.1 .venv/bin/python benchmarks/bench_report.py [--calls 2000] [--mb 100]

1. Metrics only: 2 ranks call ``report({"loss": ..., "acc": ...})`` back to back; every call
   is timed at the caller (it returns once rank 0's row is persisted on the driver and every
   rank reported). Local mode and distributed mode (``local[2]``). Median and p90 per call.
2. A checkpoint: rank 0 writes ``--mb`` MB of files (4 x 25 MB) and reports them; the time
   report() takes is compared with a plain ``shutil.copytree`` of the same files to the same
   storage directory, measured in the same rank right before (so the page cache treats both
   alike). The ratio is report / copy.

Writes benchmarks/results/report.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from spark_torch import Distributor  # noqa: E402


def metrics_loop(calls: int) -> dict[str, Any]:
    """Each rank times ``calls`` report() calls of two scalars."""
    import spark_torch

    spark_torch.report({"warmup": 1.0})
    times = []
    for i in range(calls):
        start = time.perf_counter()
        spark_torch.report({"loss": 1.0 / (i + 1), "acc": i / calls})
        times.append(time.perf_counter() - start)
    return {"median_ms": statistics.median(times) * 1000, "p90_ms": statistics.quantiles(times, n=10)[-1] * 1000}


def checkpoint_once(megabytes: int, storage: str) -> dict[str, Any]:
    """Rank 0: time a plain copy of the files, then report() with them as the checkpoint."""
    import shutil

    import spark_torch

    rank = int(os.environ["RANK"])
    with tempfile.TemporaryDirectory() as src:
        if rank == 0:
            chunk = os.urandom(1 << 20)
            for part in range(4):
                with open(os.path.join(src, f"part-{part}.bin"), "wb") as fh:
                    for _ in range(megabytes // 4):
                        fh.write(chunk)
                    fh.flush()
                    os.fsync(fh.fileno())
        copy_seconds = None
        if rank == 0:
            target = os.path.join(storage, "plain-copy")
            start = time.perf_counter()
            shutil.copytree(src, target)
            copy_seconds = time.perf_counter() - start
            shutil.rmtree(target)
        start = time.perf_counter()
        spark_torch.report({"mb": megabytes}, checkpoint=src if rank == 0 else None)
        report_seconds = time.perf_counter() - start
    return {"copy_s": copy_seconds, "report_s": report_seconds}


def run(mode: str, calls: int, megabytes: int, spark: Any | None) -> dict[str, Any]:
    storage = tempfile.mkdtemp(prefix="bench-report-")
    d = Distributor(num_processes=2, local_mode=spark is None, spark=spark, storage_path=storage, log_ranks=[])
    loop = d.run(metrics_loop, calls)
    ckpt = d.run(checkpoint_once, megabytes, storage)
    return {
        "mode": mode,
        "calls": calls,
        "report_median_ms": loop["median_ms"],
        "report_p90_ms": loop["p90_ms"],
        "checkpoint_mb": megabytes,
        "plain_copy_s": ckpt["copy_s"],
        "checkpoint_report_s": ckpt["report_s"],
        "checkpoint_ratio": ckpt["report_s"] / ckpt["copy_s"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--mb", type=int, default=100)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "report.json"))
    args = parser.parse_args()
    rows = [run("local", args.calls, args.mb, None)]
    from pyspark.sql import SparkSession

    spark = (
        SparkSession.builder.master("local[2]")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.ui.enabled", "false")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    rows.append(run("distributed local[2]", args.calls, args.mb, spark))
    spark.stop()
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump({"rows": rows, "time": time.strftime("%Y-%m-%d %H:%M:%S")}, fh, indent=2)
    print("| mode | report() median ms | p90 ms | 100 MB checkpoint: report / plain copy |")
    print("|---|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row['mode']} | {row['report_median_ms']:.3f} | {row['report_p90_ms']:.3f} | "
            f"{row['checkpoint_report_s']:.3f} s / {row['plain_copy_s']:.3f} s = {row['checkpoint_ratio']:.2f}x |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
