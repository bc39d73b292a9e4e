"""Training on a DataFrame: spark_torch's run_on_dataframe + rank_loader against PySpark's
TorchDistributor._train_on_dataframe, Petastorm and Mosaic Streaming, on the same Parquet data.

Two tables are written to Parquet once, then read back by every method: ``array`` (``features``
array<float>[32] + ``label``) and ``scalar`` (16 double columns + ``label``), ``--rows`` rows
each. ``label`` is the row's id, so every rank counts the rows it trained on into a vector of
``rows`` counters that is all-reduced at the end: "exactly once" means every counter is 1.

Every method runs the same DDP body (``ddp_loop``: ``Linear(width, 1)`` in float32, gloo, SGD,
batch 1024, one pass) with 2 ranks, distributed on ``local[2]``, the methods interleaved (the
order rotates every repetition), ``--reps`` times:

* ``spark_torch``: ``Distributor.run_on_dataframe`` + ``rank_loader`` (this process, PySpark 4);
* ``pyspark``: ``TorchDistributor._train_on_dataframe`` + its partition loader (this process). It
  needs one partition per rank (its docs: "ensure the input Spark DataFrame have evenly
  distributed partitions"), so it gets ``repartition(2)``, inside its timed call, and
  ``num_samples`` = rows // 2; spark_torch takes the DataFrame as read;
* ``petastorm``, ``streaming``: Petastorm 0.13.1's ``make_spark_converter`` +
  ``make_torch_dataloader`` and Mosaic Streaming's ``dataframe_to_mds`` + ``StreamingDataset``,
  both inside PySpark 3.5's TorchDistributor (``peers/peer_run.py``, run with the peer's side
  venv's python, its own SparkSession; ``peers/setup.sh`` makes the venvs under ``--peer-venvs``).

This process warms up spark_torch and PySpark once on 20,000 rows; a peer's process warms up on
20,000 rows of the same table before its timed run. Reported per method and table: prep s (work
before training: Petastorm's cache, Mosaic's MDS shards; none for the other two), train s (the
run call, end to end), total s, loop rows/s (rows of both ranks / the slowest rank's time from
the first batch to the last step), the count check (rows missing or repeated) and the peak RSS
of the largest rank (MB); "ratios" holds spark_torch's against each peer and issue 41's goals.

    bash benchmarks/peers/setup.sh        # once: /work/peer-venvs/{petastorm,streaming}
    SPARK_LOCAL_IP=127.0.0.1 .venv/bin/python benchmarks/bench_dataframe.py [--rows N] [--reps K]
        [--tables array,scalar] [--peers petastorm,streaming] [--out results/dataframe.json]

Results: benchmarks/results/dataframe.json (``--out``) and benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from typing import Any

BATCH = 1024
SCALARS = 16


def _rss_mb() -> tuple[float, float]:
    """This process's resident memory now, anonymous and file-backed (mapped files), MB."""
    fields = dict(line.split(":", 1) for line in open("/proc/self/status") if line.startswith(("RssAnon", "RssFile")))
    return float(fields["RssAnon"].split()[0]) / 1024, float(fields["RssFile"].split()[0]) / 1024


def ddp_loop(batches: Iterable[tuple[Any, Any]], total: int, width: int) -> dict[str, Any]:
    """The body every method runs: DDP on (x, label) batches, counting every row it trains on.

    Besides the count and the loop's time it returns, the largest over the ranks, the peak RSS,
    the RSS at the loop's end split into anonymous and file-backed memory, and the wall-clock
    times (``time.time()``) of the body's entry, the loop's first batch and its end, so the caller
    can tell the time before the loop from the loop."""
    import resource

    import torch
    import torch.distributed as dist

    entered = time.time()
    if not dist.is_initialized():  # Mosaic's body starts it first (StreamingDataset would start its own)
        dist.init_process_group("gloo", init_method="env://")
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(width, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    seen = torch.zeros(total, dtype=torch.int32)
    rows = 0
    start, loop_started = time.perf_counter(), time.time()
    for x, label in batches:
        ids = label.long()
        loss = torch.nn.functional.mse_loss(model(x.float()).squeeze(1), (label.float() / total))
        opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        seen.index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
        rows += len(ids)
    loop_s, loop_ended = time.perf_counter() - start, time.time()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    stats = torch.tensor([loop_s, peak, *_rss_mb(), entered, loop_started, loop_ended], dtype=torch.float64)
    dist.all_reduce(seen)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    rows_all = torch.tensor([rows])
    dist.all_reduce(rows_all)
    out = {
        "loop_s": float(stats[0]),
        "peak_rss_mb": float(stats[1]),
        "rss_anon_mb": float(stats[2]),
        "rss_file_mb": float(stats[3]),
        "entered_at": float(stats[4]),
        "loop_started_at": float(stats[5]),
        "loop_ended_at": float(stats[6]),
        "rows_trained": int(rows_all),
        "missing": int((seen == 0).sum()),
        "repeated": int((seen > 1).sum()),
    }
    # gloo's worker thread drops a finished all_reduce's tensors under the GIL; a group destroyed
    # (with the GIL held) before it did waits for it forever (seen in Mosaic's venv): the barrier
    # waits with the GIL released until the worker has moved past those works
    dist.barrier()
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


def write_tables(spark: Any, rows: int, where: str, tables: list[str]) -> dict[str, str]:
    """Write the named tables (``array``, ``scalar``) to Parquet under ``where``; their paths."""
    from pyspark.sql import functions as F

    base = spark.range(rows, numPartitions=8)
    label = F.col("id").cast("double").alias("label")
    columns = {
        "array": [F.array(*[F.rand(seed=i).cast("float") for i in range(32)]).alias("features"), label],
        "scalar": [*[F.rand(seed=i).alias(f"f{i}") for i in range(SCALARS)], label],
    }
    paths = {table: os.path.join(where, table) for table in tables}
    for table, path in paths.items():
        base.select(*columns[table]).write.parquet(path)
    return paths


def run_once(spark: Any, method: str, table: str, path: str, rows: int, limit: int | None = None) -> dict[str, Any]:
    """One timed run of spark_torch or PySpark in this process; ``limit``: only that many rows (the warm-up)."""
    from pyspark.ml.torch.distributor import TorchDistributor

    from spark_torch import Distributor

    start, called = time.perf_counter(), time.time()
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
    return {
        **out,
        "prep_s": 0.0,
        "train_s": train,
        "total_s": train,
        "train_called_at": called,
        "train_ended_at": called + train,
    }


def peer_command(peer: str, venvs: str, table: str, path: str, rows: int, out: str) -> tuple[list[str], dict[str, str]]:
    """argv and environment of one peer run: its side venv's python on peers/peer_run.py."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers", "peer_run.py")
    argv = [
        os.path.join(venvs, peer, "bin", "python"),
        script,
        peer,
        "--table",
        table,
        "--path",
        path,
        "--rows",
        str(rows),
        "--out",
        out,
    ]
    # this process's PySpark 4 must not leak into the peer's PySpark 3.5 (SPARK_HOME, gateway, python)
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("PYSPARK_", "SPARK_", "PYTHON")) and k != "VIRTUAL_ENV"
    }
    env.update({"SPARK_LOCAL_IP": "127.0.0.1", "PYSPARK_PYTHON": argv[0], "PYSPARK_DRIVER_PYTHON": argv[0]})
    return argv, env


def run_peer(peer: str, venvs: str, table: str, path: str, rows: int, log: str) -> dict[str, Any]:
    """One timed run of a peer in its own process (its prep and train timed there); output to ``log``."""
    with tempfile.TemporaryDirectory(prefix=f"bench_{peer}_") as tmp:
        out = os.path.join(tmp, "out.json")
        argv, env = peer_command(peer, venvs, table, path, rows, out)
        with open(log, "a") as fh:
            done = subprocess.run(argv, env=env, stdout=fh, stderr=subprocess.STDOUT, timeout=3600)
        if done.returncode != 0:
            raise RuntimeError(f"{peer} on {table} exited {done.returncode}; its output: {log}")
        with open(out) as fh:
            result: dict[str, Any] = json.load(fh)
    return result


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "prep_s": round(statistics.median(r["prep_s"] for r in runs), 2),
        "train_s": round(statistics.median(r["train_s"] for r in runs), 2),
        "total_s": round(statistics.median(r["total_s"] for r in runs), 2),
        "loop_rows_per_s": round(statistics.median(r["rows_trained"] / r["loop_s"] for r in runs)),
        "rows_trained": max(r["rows_trained"] for r in runs),
        "rows": "exactly once"
        if all(r["missing"] == 0 and r["repeated"] == 0 for r in runs)
        else f"{max(r['missing'] for r in runs):,} missing, {max(r['repeated'] for r in runs):,} repeated",
        "missing": max(r["missing"] for r in runs),
        "repeated": max(r["repeated"] for r in runs),
        "peak_rss_mb_per_rank": round(max(r["peak_rss_mb"] for r in runs)),
        # where train s goes: the run call to the last rank's first batch (Spark jobs, staging, rank
        # start, the loader's set-up), the loop, and the slowest rank's loop end to the call's return
        "before_loop_s": round(statistics.median(r["loop_started_at"] - r["train_called_at"] for r in runs), 2),
        "after_loop_s": round(statistics.median(r["train_ended_at"] - r["loop_ended_at"] for r in runs), 2),
        "loop_s": round(statistics.median(r["loop_s"] for r in runs), 2),
        "rss_at_loop_end_mb": {
            "anon": round(max(r["rss_anon_mb"] for r in runs)),
            "file": round(max(r["rss_file_mb"] for r in runs)),
        },
    }


def ratios(summary: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """spark_torch against each other method (loop rows/s, end-to-end speed-up, rank memory), and
    issue 41's goals: loop >= 2x PySpark and >= Petastorm's; end to end >= 1.25x faster than PySpark
    and >= 2x Petastorm's; rank memory no more than PySpark's."""
    ours = summary["spark_torch"]
    out: dict[str, Any] = {}
    for peer, theirs in summary.items():
        if peer == "spark_torch":
            continue
        suffix = "" if peer == "pyspark" else f"_vs_{peer}"  # PySpark's keep the names docs/dataframe.md reads
        out[f"loop_rows_per_s{suffix}"] = round(ours["loop_rows_per_s"] / theirs["loop_rows_per_s"], 2)
        out[f"total_speedup{suffix}"] = round(theirs["total_s"] / ours["total_s"], 2)
        out[f"peak_rss{suffix}"] = round(ours["peak_rss_mb_per_rank"] / theirs["peak_rss_mb_per_rank"], 2)
    goals = {
        "loop >= 2x pyspark": ("loop_rows_per_s", 2.0),
        "loop >= petastorm": ("loop_rows_per_s_vs_petastorm", 1.0),
        "end to end >= 1.25x pyspark": ("total_speedup", 1.25),
        "end to end >= 2x petastorm": ("total_speedup_vs_petastorm", 2.0),
    }
    out["goals"] = {name: out[key] >= bound for name, (key, bound) in goals.items() if key in out}
    if "peak_rss" in out:
        out["goals"]["rank memory <= pyspark"] = out["peak_rss"] <= 1.0
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--tables", default="array,scalar")
    parser.add_argument("--peers", default="petastorm,streaming", help="side-venv peers to run (empty: none)")
    parser.add_argument("--peer-venvs", default=os.environ.get("PEER_VENVS", "/work/peer-venvs"))
    parser.add_argument(
        "--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "dataframe.json")
    )
    args = parser.parse_args()
    peers = [p for p in args.peers.split(",") if p]
    missing = [p for p in peers if not os.path.exists(os.path.join(args.peer_venvs, p, ".ready"))]
    if missing:
        sys.exit(
            f"no side venv for {missing} under {args.peer_venvs}: run bash benchmarks/peers/setup.sh (or --peers '')"
        )
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ["PYSPARK_PYTHON"] = sys.executable
    import pyspark
    import torch
    from pyspark.sql import SparkSession

    loads = [open("/proc/loadavg").read().split()[:3]]
    spark = (
        SparkSession.builder.master("local[2]")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.memory", "4g")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    where = tempfile.mkdtemp(prefix="bench_dataframe_")
    log = os.path.join(
        os.path.dirname(args.out), "logs", os.path.splitext(os.path.basename(args.out))[0] + "_peers.log"
    )
    os.makedirs(os.path.dirname(log), exist_ok=True)
    open(log, "w").close()  # the peers' processes' output, Spark's included
    results: dict[str, Any] = {}
    peer_versions: dict[str, Any] = {}
    failures: list[str] = []
    try:
        tables = args.tables.split(",")
        paths = write_tables(spark, args.rows, where, tables)
        for method in ("spark_torch", "pyspark"):  # warm-up: the JVM, Python workers, imports
            run_once(spark, method, tables[-1], paths[tables[-1]], args.rows, limit=20_000)
        for table in tables:
            methods = ["spark_torch", "pyspark", *peers]
            runs: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
            for rep in range(args.reps):
                for method in methods[rep % len(methods) :] + methods[: rep % len(methods)]:  # interleaved, rotating
                    load = open("/proc/loadavg").read().split()[0]
                    if method in peers:
                        try:
                            out = run_peer(method, args.peer_venvs, table, paths[table], args.rows, log)
                        except (RuntimeError, subprocess.TimeoutExpired) as exc:  # the others' numbers still count
                            failures.append(f"{table}: {exc}")
                            print(table, method, "failed:", exc, flush=True)
                            continue
                        peer_versions[method] = out.pop("versions")
                    else:
                        out = run_once(spark, method, table, paths[table], args.rows)
                    out["load_before"] = float(load)
                    runs[method].append(out)
                    print(table, method, json.dumps(out), flush=True)
            summary: dict[str, Any] = {m: summarise(r) for m, r in runs.items() if r}
            summary["ratios"] = ratios(summary)
            summary["load_before_each_run"] = {m: [r["load_before"] for r in rs] for m, rs in runs.items()}
            results[table] = summary
            loads.append(open("/proc/loadavg").read().split()[:3])
    finally:
        shutil.rmtree(where, ignore_errors=True)
        spark.stop()
    results["config"] = {
        "rows": args.rows,
        "reps": args.reps,
        "batch": BATCH,
        "ranks": 2,
        "master": "local[2]",
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "pyspark": pyspark.__version__,
        "torch": torch.__version__,
        "peers": peer_versions,
        "loadavg_1_5_15": loads,
        "failures": failures,
    }
    print(json.dumps(results, indent=2))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(results, fh, indent=2)


if __name__ == "__main__":
    main()
