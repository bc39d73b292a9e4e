#!/usr/bin/env python
"""What stall detection and the lazy package cost: DDP throughput with the stack sampler on vs
off, launch time on vs off, and a rank's import time with the lazy ``spark_torch/__init__``
vs the eager one it replaced.

    SPARK_LOCAL_IP=127.0.0.1 .venv/bin/python benchmarks/bench_stall.py [--pairs 10]

1. DDP throughput, interleaved A/B: the ``training`` body of ``make bench`` (a DDP MLP, N=2,
   local mode, samples/s measured inside the loop by rank 0) with detection at its default
   (``stall_timeout=120``: one sample a second, as at any timeout of 10 s or more) and at its most frequent (``stall_timeout=2``:
   five samples a second) against ``stall_timeout=0`` (off). Each pair runs both back to back,
   order alternating; the ratio is the geometric mean of the pair ratios with a 95% interval.
2. Launch: a trivial process-group function (N=2, local mode, warm), on vs off, interleaved.
3. Import: a fresh interpreter importing ``spark_torch.rank.function_main``; "eager" adds the
   modules the old eager ``spark_torch/__init__`` loaded (the driver's public API). Medians of
   ``-X importtime`` totals, which exclude interpreter start-up.

Writes benchmarks/results/stall.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.dirname(HERE))

from analysis import alternating_pairs  # noqa: E402
from bodies import train_ddp, trivial_pg  # noqa: E402

from spark_torch import Distributor  # noqa: E402

#: what the eager spark_torch/__init__.py imported before it became lazy
EAGER = (
    "spark_torch.driver.api.deepspeed",
    "spark_torch.driver.api.distributor",
    "spark_torch.driver.result",
    "spark_torch.driver.api.torch_distributor",
    "spark_torch.errors",
    "spark_torch.reporting.api",
)


def _ab(pairs: int, name: str, run: Any) -> dict[str, Any]:
    """``run(stall_timeout)`` -> value; pairs of (on, off), order alternating."""
    result = alternating_pairs(pairs, lambda: run(float(name)), lambda: run(0))
    return {"on": result.pop("a"), "off": result.pop("b"), **result}


def throughput(stall_timeout: float, steps: int) -> float:
    out = Distributor(num_processes=2, stall_timeout=stall_timeout, log_ranks=[]).run(train_ddp, steps)
    return float(out["samples_per_s"])


def launch(stall_timeout: float) -> float:
    start = time.perf_counter()
    Distributor(num_processes=2, stall_timeout=stall_timeout, log_ranks=[]).run(trivial_pg)
    return time.perf_counter() - start


def import_ms(modules: tuple[str, ...], reps: int) -> float:
    code = "; ".join(f"import {m}" for m in modules)
    totals = []
    for _ in range(reps):
        done = subprocess.run(
            [sys.executable, "-X", "importtime", "-c", code], capture_output=True, text=True, check=True
        )
        # -X importtime: "import time: self [us] | cumulative | name"; top-level imports have no indent
        top = [line.split("|") for line in done.stderr.splitlines() if line.startswith("import time:") and "|" in line]
        totals.append(
            sum(int(c.strip()) for _, c, name in top if not name.startswith("  ") and c.strip().isdigit()) / 1000
        )
    return statistics.median(totals)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=10)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    results: dict[str, Any] = {}
    throughput(120, 20)  # warm: the template, torch's first import
    for timeout in ("120", "2"):
        results[f"ddp_throughput_{timeout}"] = _ab(args.pairs, timeout, lambda t: throughput(t, args.steps))
    results["launch_120"] = _ab(args.pairs, "120", launch)
    rank = ("spark_torch.rank.function_main",)
    results["rank_import_ms"] = {"lazy": import_ms(rank, 15), "eager": import_ms(rank + EAGER, 15)}
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "stall.json"), "w") as fh:
        json.dump(results, fh, indent=1)
    for key, value in results.items():
        if "ratio" in value:
            print(
                f"{key}: on/off {value['ratio']:.3f} (95% CI {value['low']:.3f}-{value['high']:.3f}, {value['pairs']} pairs); "
                f"median on {statistics.median(value['on']):.4g}, off {statistics.median(value['off']):.4g}"
            )
        else:
            print(f"{key}: {value}")


if __name__ == "__main__":
    main()
