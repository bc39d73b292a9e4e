#!/usr/bin/env python
"""spark_torch benchmarks: our Distributor vs PySpark's TorchDistributor vs the floor.

    make bench                                   # = SPARK_LOCAL_IP=127.0.0.1 .venv/bin/python benchmarks/run.py
    .venv/bin/python benchmarks/run.py --quick   # smoke run: 1 repetition, N=2 only
    .venv/bin/python benchmarks/run.py --only launch --only logging --reps 5

Every Spark master configuration runs in its own subprocess of this script (``--worker JOB``,
one SparkContext per process); the worker writes its measurements as JSON, this parent merges
them into ``benchmarks/results/`` (``results.json``, ``results.md``, ``results.png``; the
``--quick`` run goes to ``benchmarks/results/quick/``). Within a job the launchers alternate
(rotating the order every repetition) so that background load hits them alike.
See benchmarks/README.md for what each benchmark measures and its floor.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from importlib import metadata
from typing import Any

# the benchmark modules sit next to this script: on sys.path[0] when it runs as a script (also
# for the workers, ``run.py --worker JOB``); added here for any other way of loading it
HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from analysis import analyse  # noqa: E402
from chart import write_chart  # noqa: E402
from jobs import BENCHES, DEFAULT_RESULTS, JOBS, ROOT, WORKER_TIMEOUT, Job  # noqa: E402
from report_md import fmt, write_markdown  # noqa: E402
from worker import worker_main  # noqa: E402


def versions() -> dict[str, Any]:
    info: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
    }
    for mod in ("torch", "pyspark", "cloudpickle", "pyarrow", "spark_torch"):
        try:
            m = __import__(mod)
            info[mod] = getattr(m, "__version__", "?")
        except Exception as exc:  # noqa: BLE001
            info[mod] = f"unavailable ({exc})"
    try:  # an optional peer: its version is recorded where it was measured, not looked up when analysing
        info["ray"] = metadata.version("ray")
    except metadata.PackageNotFoundError:
        pass
    try:
        java = subprocess.run(["java", "-version"], capture_output=True, text=True, timeout=30)
        info["java"] = (java.stderr or java.stdout).splitlines()[0]
    except Exception:  # noqa: BLE001
        info["java"] = "?"
    try:
        info["spark_torch_commit"] = subprocess.run(
            ["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=30
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", ROOT, "status", "--porcelain", "spark_torch"], capture_output=True, text=True, timeout=30
        ).stdout.strip()
        info["spark_torch_dirty"] = bool(dirty)
    except Exception:  # noqa: BLE001
        pass
    return info


def run_jobs(
    args: argparse.Namespace,
    jobs: list[Job],
    results_dir: str,
    after_each: Callable[[list[dict[str, Any]]], None] | None = None,
) -> list[dict[str, Any]]:
    logs = os.path.join(results_dir, "logs")
    os.makedirs(logs, exist_ok=True)
    env = dict(os.environ)
    env.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    env["PYTHONUNBUFFERED"] = "1"
    outputs = []
    for job in jobs:
        out = os.path.join(results_dir, f"{job.name}.json.tmp")
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--worker",
            job.name,
            "--reps",
            str(args.reps),
            "--out",
            out,
            "--results-dir",
            results_dir,
        ] + (["--quick"] if args.quick else [])
        print(f"[bench] {job.name} ({job.bench}, {job.mode}, master={job.master}) ...", flush=True)
        t = time.time()
        with open(os.path.join(logs, f"{job.name}.log"), "w") as log:
            try:
                rc = subprocess.run(
                    cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=WORKER_TIMEOUT, cwd=ROOT
                ).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        try:
            with open(out) as fh:
                data = json.load(fh)
            os.unlink(out)
        except (FileNotFoundError, ValueError):
            data = {"job": job.name, "records": [], "notes": {}}
        data["returncode"] = rc
        data["wall_seconds"] = time.time() - t
        outputs.append(data)
        errors = sum(len(r["errors"]) for r in data["records"])
        if after_each is not None:
            after_each(outputs)
        print(
            f"[bench]   done in {time.time() - t:.0f}s (exit {rc}, {errors} failed runs; "
            f"log: {os.path.relpath(os.path.join(logs, job.name + '.log'), ROOT)})",
            flush=True,
        )
    return outputs


def parent_main(args: argparse.Namespace) -> int:
    results_dir = args.results_dir or (os.path.join(DEFAULT_RESULTS, "quick") if args.quick else DEFAULT_RESULTS)
    os.makedirs(results_dir, exist_ok=True)
    wanted = set(args.only or [])
    unknown = wanted - set(BENCHES) - {j.name for j in JOBS}
    if unknown:
        print(f"unknown benchmark(s) {sorted(unknown)}; choose from {BENCHES} or jobs {[j.name for j in JOBS]}")
        return 2
    jobs = [j for j in JOBS if not wanted or j.bench in wanted or j.name in wanted]
    start = time.time()
    load0 = os.getloadavg()
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "command": " ".join(
            [os.path.relpath(sys.executable, ROOT)] + [os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]
        ),
        "reps": args.reps,
        "quick": args.quick,
        "versions": versions(),
        "loadavg_start": [round(x, 2) for x in load0],
    }
    print(
        f"[bench] {len(jobs)} jobs, {args.reps} repetition(s) -> {os.path.relpath(results_dir, ROOT)}/; "
        f"load average {load0[0]:.1f} on {os.cpu_count()} CPUs",
        flush=True,
    )

    def report(outputs: list[dict[str, Any]]) -> dict[str, Any]:
        """(Re)write results.json/.md/.png; called after every job so a cut-short run still reports."""
        meta["wall_seconds"] = time.time() - start
        meta["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
        meta["jobs_done"] = f"{len(outputs)} of {len(jobs)}"
        analysis = analyse(outputs)
        with open(os.path.join(results_dir, "results.json"), "w") as fh:
            json.dump(
                {"meta": meta, "targets": analysis["targets"], "scaling": analysis["scaling"], "jobs": outputs},
                fh,
                indent=1,
                default=str,
            )
        write_markdown(os.path.join(results_dir, "results.md"), meta, analysis, outputs)
        try:
            write_chart(os.path.join(results_dir, "results.png"), analysis)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
        return analysis

    outputs = run_jobs(args, jobs, results_dir, after_each=report)
    analysis = report(outputs)
    print(
        f"[bench] finished in {meta['wall_seconds']:.0f}s; see {os.path.relpath(results_dir, ROOT)}/results.md",
        flush=True,
    )
    for t in analysis["targets"]:
        met = "?" if t["met"] is None else ("met" if t["met"] else "NOT met")
        print(f"[bench]   {met:8s} {fmt(t['measured'])} {t['op']} {t['limit']}  {t['target']}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: 1 repetition, N=2 only")
    p.add_argument(
        "--only", action="append", metavar="NAME", help=f"benchmark ({', '.join(BENCHES)}) or job name; repeatable"
    )
    p.add_argument("--reps", type=int, default=None, help="repetitions per configuration (default 3; --quick 1)")
    p.add_argument("--results-dir", default=None, help="default benchmarks/results (quick: benchmarks/results/quick)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.reps is None:
        args.reps = 1 if args.quick else 3
    if args.worker:
        return worker_main(args)
    return parent_main(args)


if __name__ == "__main__":
    sys.exit(main())
