"""Per-batch cost of a rank's DataFrame loader against the rows it holds (no Spark, no ranks).

A node's rows are staged the way ``run_on_dataframe`` stages them (``write_node_data`` from
10,000-row Arrow record batches, Spark's ``maxRecordsPerBatch``), for 62.5k, 500k and 4M rows
per rank, with one column of each supported kind: ``features`` array<float>[32], ``label``
double, ``vec`` Spark ML vector (8 wide, dense and sparse rows), ``name`` string, ``blob``
binary. For each size: milliseconds per batch of 1024 rows, shuffled and in order, for all
columns together and for each alone: the mean over one whole epoch (what training pays,
first touches of the memory-mapped pages included); the process's peak resident memory; and,
with ``--old``, the median of ``--batches`` shuffled batches of the loader this replaced (Arrow
IPC file + ``Table.take``) and of chunk-aware ``take`` (the batch's rows grouped by record
batch, one ``take`` per chunk), on the array column.

    .venv/bin/python benchmarks/bench_loader.py [--sizes 62500,500000,4000000] [--old] [--dir /tmp/x]

Results: benchmarks/results/loader.json and benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import tempfile
import time
from typing import Any

BATCH = 1024
CHUNK = 10_000
COLUMNS = ["features", "label", "vec", "name", "blob"]


def make_batch(start: int, rows: int) -> Any:
    import numpy as np
    import pyarrow as pa

    rng = np.random.default_rng(start)
    ids = np.arange(start, start + rows)
    features = pa.FixedSizeListArray.from_arrays(pa.array(rng.random(rows * 32, dtype=np.float32)), 32)
    features = features.cast(pa.list_(pa.float32()))  # Spark's array<float> is a variable-size list
    dense = ids % 2 == 0
    value_lengths = np.where(dense, 8, 2)
    value_offsets = np.concatenate([[0], np.cumsum(value_lengths)]).astype(np.int32)
    index_lengths = np.where(dense, 0, 2)
    index_offsets = np.concatenate([[0], np.cumsum(index_lengths)]).astype(np.int32)
    indices = np.tile(np.array([1, 6], dtype=np.int32), int((~dense).sum()))
    vec = pa.StructArray.from_arrays(
        [
            pa.array(dense.astype(np.int8)),
            pa.array(np.where(dense, 0, 8).astype(np.int32), mask=dense),
            pa.ListArray.from_arrays(pa.array(index_offsets), pa.array(indices), mask=pa.array(dense)),
            pa.ListArray.from_arrays(pa.array(value_offsets), pa.array(rng.random(int(value_lengths.sum())))),
        ],
        names=["type", "size", "indices", "values"],
    )
    names = pa.array(ids).cast(pa.string())
    return pa.record_batch(
        [features, pa.array(ids.astype(np.float64)), vec, names, names.cast(pa.binary())], names=COLUMNS
    )


def stage(directory: str, rows: int) -> str:
    from spark_torch.node.staging import write_node_data

    path, written = write_node_data((make_batch(s, min(CHUNK, rows - s)) for s in range(0, rows, CHUNK)), directory)
    assert written == rows
    return path


def epoch_ms(loader: Any) -> float:
    """Mean milliseconds per batch over one whole epoch (first touches of the mapped pages included)."""
    start = time.perf_counter()
    count = sum(1 for _ in loader)
    return (time.perf_counter() - start) * 1000 / count


def measure_ours(path: str) -> dict[str, Any]:
    from spark_torch.rank.data import RankDataset

    next(iter(RankDataset(path, batch_size=2, columns=COLUMNS, local_rank=0, local_world_size=1)))  # imports
    out: dict[str, Any] = {}
    for shuffle in (True, False):
        for cols in [COLUMNS] + [[c] for c in COLUMNS]:
            ds = RankDataset(
                path, batch_size=BATCH, columns=cols, shuffle=shuffle, seed=0, local_rank=0, local_world_size=1
            )
            out[f"{'shuffled' if shuffle else 'in_order'}/{cols[0] if len(cols) == 1 else 'all'}"] = round(
                epoch_ms(ds), 3
            )
    return out


def measure_old(rows: int, directory: str, batches: int) -> dict[str, float]:
    """The replaced loader (an Arrow IPC file, ``Table.take`` per batch) and chunk-aware take."""
    import numpy as np
    import pyarrow as pa

    path = os.path.join(directory, "old.arrow")
    first = make_batch(0, 1)
    with pa.ipc.new_file(path, first.schema) as writer:
        for s in range(0, rows, CHUNK):
            writer.write_batch(make_batch(s, min(CHUNK, rows - s)).select(first.schema.names))
    table = pa.ipc.open_file(pa.memory_map(path, "r")).read_all().select(["features"])
    rng = np.random.default_rng(0)
    picks = [rng.choice(rows, BATCH, replace=False) for _ in range(batches)]
    column = table.column(0)
    bounds = np.cumsum([0] + [len(c) for c in column.chunks])

    def old(idx: Any) -> Any:
        return table.take(pa.array(idx))

    def chunk_aware(idx: Any) -> Any:
        chunk = np.searchsorted(bounds, idx, side="right") - 1
        return pa.concat_arrays(
            [column.chunks[k].take(pa.array(idx[chunk == k] - bounds[k])) for k in np.unique(chunk)]
        )

    result = {}
    for name, fn in (("arrow_table_take", old), ("chunk_aware_take", chunk_aware)):
        times = []
        for idx in picks:
            start = time.perf_counter()
            fn(idx)
            times.append(time.perf_counter() - start)
        result[f"shuffled/features/{name}"] = round(statistics.median(times) * 1000, 3)
    os.unlink(path)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="62500,500000,4000000")
    parser.add_argument("--batches", type=int, default=20, help="batches timed for --old (median)")
    parser.add_argument("--old", action="store_true", help="also time the replaced loader and chunk-aware take")
    parser.add_argument("--dir", default=None, help="where to stage (default: a temp folder, removed after)")
    args = parser.parse_args()
    import numpy
    import pyarrow
    import torch

    torch.set_num_threads(1)
    results: dict[str, Any] = {"sizes": {}}
    for rows in [int(s) for s in args.sizes.split(",")]:
        directory = tempfile.mkdtemp(prefix="bench_loader_", dir=args.dir)
        try:
            start = time.perf_counter()
            path = stage(os.path.join(directory, "data"), rows)
            entry: dict[str, Any] = {"stage_s": round(time.perf_counter() - start, 2)}
            entry["ms_per_batch"] = measure_ours(path)
            entry["max_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
            if args.old:
                entry["ms_per_batch"].update(measure_old(rows, directory, args.batches))
            results["sizes"][str(rows)] = entry
            print(rows, json.dumps(entry), flush=True)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
    results["config"] = {
        "batch": BATCH,
        "chunk_rows": CHUNK,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "numpy": numpy.__version__,
        "pyarrow": pyarrow.__version__,
        "torch": torch.__version__,
    }
    os.makedirs(os.path.join(os.path.dirname(__file__), "results"), exist_ok=True)
    with open(os.path.join(os.path.dirname(__file__), "results", "loader.json"), "w") as fh:
        json.dump(results, fh, indent=2)


if __name__ == "__main__":
    main()
