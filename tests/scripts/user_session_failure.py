"""A newcomer's script: its own SparkSession at Spark's default console level (progress bar
on), a distributed run whose rank 1 raises (argv[2] ``fail``) or raises once and succeeds after
a restart (``restart``). Prints ``=== run() ===`` before the run; after it, the run's error as
Python prints it, then ``=== after ===`` and what the console looks like for Spark again (``FACT``
lines). ``KEY=VALUE`` arguments after the mode: a second run in the same session (no second JVM to
start) with those variables in the driver's environment, where spark_torch reads its settings for
each run; it prints the same three parts again."""

import os
import shutil
import sys
import tempfile
import traceback

from pyspark.sql import SparkSession

master, mode, then = sys.argv[1], sys.argv[2], dict(arg.split("=", 1) for arg in sys.argv[3:])
spark = SparkSession.builder.master(master).config("spark.driver.host", "127.0.0.1").getOrCreate()
jvm = spark.sparkContext._jvm
level = jvm.org.apache.logging.log4j.LogManager.getLogger("org.apache.spark.scheduler.TaskSetManager").getLevel()
before = (str(level.toString()), bool(spark.sparkContext._jsc.sc().progressBar().isDefined()))

from spark_torch import DistributedRunError, Distributor  # noqa: E402
from spark_torch.driver.spark import quiet  # noqa: E402


def train(flag: str, once: bool) -> int:
    import os

    if os.environ["RANK"] == "1":
        marker = os.path.join(flag, "failed")
        if not once or not os.path.exists(marker):
            open(marker, "w").close()
            raise ValueError("rank one is broken")
    return int(os.environ["WORLD_SIZE"])


def one_run() -> None:
    flag = tempfile.mkdtemp()
    print("=== run() ===", flush=True)
    try:
        print(
            "RESULT",
            Distributor(num_processes=2, local_mode=False, spark=spark, max_restarts=1 if mode == "restart" else 0).run(
                train, flag, mode == "restart"
            ),
            flush=True,
        )
    except DistributedRunError:
        traceback.print_exc()
        sys.stderr.flush()
    restored = quiet.wait_restored(60)
    level = jvm.org.apache.logging.log4j.LogManager.getLogger("org.apache.spark.scheduler.TaskSetManager").getLevel()
    after = (str(level.toString()), bool(spark.sparkContext._jsc.sc().progressBar().isDefined()))
    print("=== after ===", flush=True)
    print(f"FACT restored {restored} levels {before == after} {after}", flush=True)
    shutil.rmtree(flag)


one_run()
if then:
    os.environ.update(then)
    one_run()
spark.stop()
