"""The ``spark-torch`` command run several times in one process (one driver JVM for all): its
entry point, ``spark_torch.cli.main.main`` (what the console script and ``python -m
spark_torch`` call), once per ``VARIABLES`` argument before ``--``, with the command's arguments
after it. ``VARIABLES`` is ``K=V,K=V`` (or ``-`` for none): spark_torch's variables set for that
run only (the CLI reads them for each run). Prints ``=== cli VARIABLES ===`` before each run and
``=== exit STATUS ===`` after it, once every task of the run has ended (a killed task's log line
then belongs to its own run)."""

import os
import sys
import time

from pyspark.sql import SparkSession

from spark_torch.cli.main import main
from spark_torch.driver.spark import quiet

OURS = ("SPARK_TORCH_SPARK_LOGS", "SPARK_TORCH_CLI_VERBOSE")


def tasks_ended(timeout: float = 60) -> None:
    """Wait until no executor runs a task of the run (the failed stage's killed tasks included)."""
    spark = SparkSession.getActiveSession()
    if spark is None:
        return
    tracker = spark.sparkContext._jsc.sc().statusTracker()
    deadline = time.monotonic() + timeout
    while any(info.numRunningTasks() for info in tracker.getExecutorInfos()):
        if time.monotonic() > deadline:
            sys.exit(
                f"cli_runs.py: the run's tasks still ran {timeout:.0f} s after it ended; its killed tasks never stopped"
            )
        time.sleep(0.2)
    if not quiet.wait_restored(timeout):
        sys.exit(f"cli_runs.py: Spark's log levels were not restored {timeout:.0f} s after the run ended")


split = sys.argv.index("--")
runs, argv = sys.argv[1:split], sys.argv[split + 1 :]
for variables in runs:
    for name in OURS:
        os.environ.pop(name, None)
    os.environ.update(dict(pair.split("=", 1) for pair in variables.split(",") if pair != "-"))
    print(f"=== cli {variables} ===", flush=True)
    status = main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    tasks_ended()
    print(f"=== exit {status} ===", flush=True)
