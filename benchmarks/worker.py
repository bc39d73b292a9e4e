"""The worker side: one job in its own subprocess (``run.py --worker JOB``).

``Worker`` is the harness of ``worker_base.py`` with every benchmark family mixed in (launch,
training and scaling from ``worker_launch.py``; logging and result from ``worker_io.py``;
profile from ``worker_profile.py``; the channel from ``bench_channel.py``), so a job's ``bench`` names the method to call.
``worker_main`` runs one job with the job's environment and writes its records, notes, wall
time and load averages as JSON to ``--out`` for the parent to merge, even when the benchmark fails.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from bench_channel import ChannelBenchmark
from jobs import JOBS
from worker_io import IOBenchmarks
from worker_launch import LaunchBenchmarks
from worker_profile import ProfileBenchmark


class Worker(LaunchBenchmarks, IOBenchmarks, ProfileBenchmark, ChannelBenchmark):
    """Every benchmark body on one harness: ``getattr(worker, job.bench)()`` runs a job."""


def worker_main(args: argparse.Namespace) -> int:
    job = next(j for j in JOBS if j.name == args.worker)
    os.environ.update(dict(job.env))
    start = time.time()
    load0 = [round(x, 2) for x in os.getloadavg()]
    w = Worker(job, args.reps, args.quick)
    w.results_dir = args.results_dir
    try:
        getattr(w, job.bench)()
    finally:
        out = {
            "job": job.name,
            "records": w.records,
            "notes": w.notes,
            "seconds": time.time() - start,
            "loadavg_start": load0,
            "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        }
        with open(args.out, "w") as fh:
            json.dump(out, fh, indent=1, default=str)
        if w.spark is not None:
            w.spark.stop()
    return 0
