"""A driver whose executors run the Python given as argv[2] on master argv[1]: it runs a tiny
distributed function and prints the outcome as one line (``RESULT ...`` or ``ERROR Type: message``), then how each of
the run's attempts ended (``ATTEMPTS launch failed``).
With argv[3] ``builder``, argv[2] is given as ``SparkSession.builder.config("spark.pyspark.python",
...)`` instead (which PySpark does not use for a session started in this process). More Pythons
after argv[2]: one session after another in this process, each with its own SparkContext (and
PYSPARK_PYTHON) in the same JVM, each outcome after a line ``=== PYTHON ===``."""

import os
import sys
import time

builder = sys.argv[3:] == ["builder"]
pythons = sys.argv[2:3] if builder else sys.argv[2:]

from pyspark.sql import SparkSession  # noqa: E402

from spark_torch import Distributor  # noqa: E402

if os.environ.get("PREFLIGHT_PROBE_SECONDS"):  # the probe's deadline for a job whose tasks never start
    import spark_torch.driver.spark.preflight as preflight

    preflight.PROBE_SECONDS = float(os.environ["PREFLIGHT_PROBE_SECONDS"])

for python in pythons:
    if len(pythons) > 1:
        print(f"=== {python} ===", flush=True)
    if not builder:
        os.environ["PYSPARK_PYTHON"] = python  # read once, when the SparkContext starts
    spark = (
        SparkSession.builder.master(sys.argv[1])
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.pyspark.python" if builder else "spark.torch.unused", python)
        .getOrCreate()
    )
    if os.environ.get("PREFLIGHT_WAIT_SLOTS"):  # the executors registered first: the probe's short
        # deadline above is for tasks that never start, not for executor JVMs still starting
        from tests.sessions import wait_for_slots  # the tests' PYTHONPATH has the checkout

        wait_for_slots(spark, int(os.environ["PREFLIGHT_WAIT_SLOTS"]))
    started = time.monotonic()
    distributor = Distributor(num_processes=2, local_mode=False, spark=spark)
    try:
        print("RESULT", distributor.run(os.getpid), flush=True)
    except Exception as exc:  # noqa: BLE001 - the outcome is the output
        print(f"ERROR {type(exc).__name__}: {exc}", flush=True)
    run = distributor.last_run
    print("ATTEMPTS", ",".join(str(a.end) for a in run.attempts) if run is not None else "-", flush=True)
    print(f"SECONDS {time.monotonic() - started:.1f}", flush=True)
    spark.stop()
