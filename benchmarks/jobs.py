"""What the benchmarks run: paths, sizes, time limits, launcher names, and the jobs.

One ``Job`` is one worker subprocess (``run.py --worker JOB``) with its own Spark master
configuration (or no session at all); ``JOBS`` lists them in the order the parent runs them and
``BENCHES`` names the benchmark families that ``--only`` accepts. The launcher names here are
the keys of every record, table and chart, so the worker, the analysis and the reports share them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
FLOOR_SCRIPT = os.path.join(HERE, "floor_script.py")
DEFAULT_RESULTS = os.path.join(HERE, "results")
WORKER_TIMEOUT = 15 * 60
RUN_TIMEOUT = 600.0
LOG_LINES = 100_000
WORK_ITERS = 10_000  # steps of the CPU-bound loop that prints LOG_LINES lines (chatter_work)
TRAINING_PAIRS = 12
RESULT_BYTES = 256 << 20

OURS = "spark_torch"
TD = "TorchDistributor"
TORCHRUN = "torchrun"
FLOOR = "floor"
RAY = "Ray Train"  # an optional peer: measured when ray[train] is installed


@dataclass(frozen=True)
class Job:
    name: str
    bench: str
    mode: str  # "local" | "distributed" | "-"
    master: str | None  # Spark master of the worker's session (None: no session)
    conf: tuple[tuple[str, str], ...] = ()
    quick: bool = True  # part of --quick
    env: tuple[tuple[str, str], ...] = ()  # environment of the worker process


JOBS = [
    Job("launch-local", "launch", "local", "local[2]"),
    Job("launch-dist-local4", "launch", "distributed", "local[4]"),
    Job("launch-dist-cluster", "launch", "distributed", "local-cluster[2,1,1024]"),
    Job("training", "training", "local", "local[2]"),
    Job("logging-local", "logging", "local", "local[2]"),
    Job("logging-dist", "logging", "distributed", "local[2]"),
    Job("result-local", "result", "local", "local[2]"),
    Job(
        "result-dist",
        "result",
        "distributed",
        "local[2]",
        (("spark.driver.maxResultSize", "2g"), ("spark.driver.memory", "4g")),
    ),
    # what a result from another host takes: streamed over the run's authenticated channel
    Job(
        "result-dist-channel",
        "result",
        "distributed",
        "local[2]",
        (("spark.driver.maxResultSize", "2g"), ("spark.driver.memory", "4g")),
        env=(("SPARK_TORCH_RESULT_TRANSFER", "channel"),),
    ),
    # ... and without a channel: 16 MiB Arrow rows through Spark's result channel
    Job(
        "result-dist-spark",
        "result",
        "distributed",
        "local[2]",
        (("spark.driver.maxResultSize", "2g"), ("spark.driver.memory", "4g")),
        env=(("SPARK_TORCH_RESULT_TRANSFER", "spark"),),
    ),
    Job("scaling", "scaling", "local", None),
    # many nodes on one executor: per-node launch cost of a distributed run, N=2..32 (one node per
    # rank), all forked from one executor's warm-start template
    Job("launch-scale", "launch_scale", "distributed", "local[32]", quick=False),
    Job("profile", "profile", "local", None),
    # the channel alone, no Spark session: AES-GCM framing vs the HMAC framing it replaced, and
    # 32-256 node clients against one driver end (bench_channel.py, ChannelBenchmark.channel)
    Job("channel", "channel", "-", None),
]
BENCHES = ["launch", "launch_scale", "training", "logging", "result", "scaling", "profile", "channel"]
#: node counts of the launch_scale job (a local[32] session: one slot per node)
SCALE_NODES = [2, 4, 8, 16, 32]
