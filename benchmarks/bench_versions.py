#!/usr/bin/env python
"""Two versions of spark_torch side by side: launch time and DDP throughput of one commit
against another (e.g. before and after a restructuring), interleaved A/B in one run.

    SPARK_LOCAL_IP=127.0.0.1 .venv/bin/python benchmarks/bench_versions.py BEFORE [AFTER] [--pairs 10]

BEFORE and AFTER are git revisions (AFTER defaults to the working tree). Each is checked out
into a temporary ``git worktree`` and driven by a long-lived worker process of its own (this
script with ``--worker``, ``PYTHONPATH`` pointing at that checkout, the same interpreter and
packages for both). The workers take turns, order alternating every pair, so background load
hits both alike:

1. launch: a trivial process-group function (init_process_group on gloo, one all_reduce),
   N=2, local mode, warm (each version keeps its own warm-start template);
2. throughput: the ``training`` body of ``make bench`` (a DDP MLP, N=2, local mode), samples/s
   measured by rank 0 inside the loop.

Ratios are AFTER/BEFORE: the geometric mean of the pair ratios with a 95% interval. Writes
benchmarks/results/versions.json and prints a table. Local mode only: distributed mode adds
the same Spark stage to both.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _worker() -> None:
    """Serve ``launch`` / ``train STEPS`` lines on stdin with one JSON line each on stdout."""
    sys.path.insert(0, HERE)
    import bodies
    import cloudpickle

    from spark_torch import Distributor

    cloudpickle.register_pickle_by_value(bodies)
    out = sys.stdout
    sys.stdout = sys.stderr  # the run's own lines must not mix with the answers
    for line in sys.stdin:
        command, *rest = line.split()
        start = time.perf_counter()
        if command == "launch":
            Distributor(num_processes=2, log_ranks=[]).run(bodies.trivial_pg)
            value = time.perf_counter() - start
        else:
            value = float(
                Distributor(num_processes=2, log_ranks=[]).run(bodies.train_ddp, int(rest[0]))["samples_per_s"]
            )
        out.write(json.dumps({"value": value}) + "\n")
        out.flush()


class _Version:
    """One checkout and its worker process."""

    def __init__(self, label: str, tree: str) -> None:
        self.label = label
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([tree, HERE])}
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=tree,
        )

    def ask(self, command: str, timeout: float = 600.0) -> float:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()  # the worker's own runs are bounded; a dead worker gives ""
        if not line:
            raise RuntimeError(f"the {self.label} worker exited (rc {self.proc.wait(timeout)}) during {command!r}")
        return float(json.loads(line)["value"])

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _checkout(rev: str, into: str) -> str:
    subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", "--quiet", into, rev], check=True)
    return into


def _pairs(before: _Version, after: _Version, pairs: int, command: str) -> dict[str, Any]:
    sys.path.insert(0, HERE)
    from analysis import alternating_pairs

    result = alternating_pairs(pairs, lambda: after.ask(command), lambda: before.ask(command))
    return {"after": result.pop("a"), "before": result.pop("b"), **result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before", help="git revision of the reference")
    parser.add_argument("after", nargs="?", default=None, help="git revision to compare (default: the working tree)")
    parser.add_argument("--pairs", type=int, default=10)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    revs = {
        "before": subprocess.run(
            ["git", "-C", ROOT, "rev-parse", "--short", args.before], capture_output=True, text=True, check=True
        ).stdout.strip()
    }
    with tempfile.TemporaryDirectory(prefix="spark-torch-versions-") as tmp:
        trees = [_checkout(args.before, os.path.join(tmp, "before"))]
        try:
            if args.after is None:
                after_tree, revs["after"] = ROOT, "working tree"
            else:
                after_tree = _checkout(args.after, os.path.join(tmp, "after"))
                trees.append(after_tree)
                revs["after"] = args.after
            before, after = _Version("before", trees[0]), _Version("after", after_tree)
            try:
                for version in (before, after):  # warm: the template, torch's first import
                    version.ask("launch")
                    version.ask("train 20")
                results: dict[str, Any] = {"revisions": revs}
                results["launch"] = _pairs(before, after, args.pairs, "launch")
                results["ddp_throughput"] = _pairs(before, after, args.pairs, f"train {args.steps}")
            finally:
                before.close()
                after.close()
        finally:
            for tree in trees:
                subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", tree], check=False)
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "versions.json"), "w") as fh:
        json.dump(results, fh, indent=1)
    print(f"before {revs['before']}, after {revs['after']}")
    for key in ("launch", "ddp_throughput"):
        value = results[key]
        print(
            f"{key}: after/before {value['ratio']:.3f} (95% CI {value['low']:.3f}-{value['high']:.3f}, "
            f"{value['pairs']} pairs); median after {statistics.median(value['after']):.4g}, "
            f"before {statistics.median(value['before']):.4g}"
        )


if __name__ == "__main__":
    if sys.argv[1:] == ["--worker"]:
        _worker()
    else:
        main()
