"""A real Ctrl-C (SIGINT to this process) during each Py4J call of one quiet period.

Its own SparkSession (local[1], PySpark's own SIGINT handler, which cancels the jobs and raises
KeyboardInterrupt), a logger the user set (TaskSetManager at INFO). First one quiet period is
counted: how many Py4J calls the main thread makes from entering it to leaving it (the snapshot,
the silencing, the progress bar, the count of running tasks at its end, the restore). Then, for
each of those calls and each side of it, one period more with a SIGINT sent to this process
``before`` the call reaches the JVM or ``after`` the JVM answered (before the caller has the
answer). After each, the state of every silenced logger and of the progress bar is read with no
interrupt and compared with the state before the first period. Prints one JSON line:
``{"calls": N, "trials": T, "interrupted": I, "wrong": [...]}``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from typing import Any

from pyspark.sql import SparkSession

spark = (
    SparkSession.builder.master("local[1]")
    .config("spark.driver.host", "127.0.0.1")
    .config("spark.ui.enabled", "false")
    .getOrCreate()
)

from spark_torch.driver.spark import quiet  # noqa: E402

log4j = spark.sparkContext._jvm.org.apache.logging.log4j
log4j.core.config.Configurator.setLevel("org.apache.spark.scheduler.TaskSetManager", log4j.Level.INFO)


def state() -> tuple[dict[str, tuple[str | None, str]], bool]:
    """Each silenced logger's configured level (None: not configured) and effective level; the bar."""
    configured = log4j.LogManager.getContext(False).getConfiguration().getLoggers()
    levels = {}
    for name in quiet.NOISY_LOGGERS:
        own = configured.get(name)
        effective = str(log4j.LogManager.getLogger(name).getLevel().toString())
        levels[name] = (None if own is None else str(own.getLevel().toString()), effective)
    return levels, bool(spark.sparkContext._jsc.sc().progressBar().isDefined())


client_class = type(spark.sparkContext._gateway._gateway_client)
original_send = client_class.send_command
plan: dict[str, Any] = {"active": False, "count": 0, "target": 0, "side": "", "sent": False}


def send_command(self: Any, *args: Any, **kwargs: Any) -> Any:
    fire = False
    if plan["active"] and threading.current_thread() is threading.main_thread():
        plan["count"] += 1
        fire = plan["count"] == plan["target"] and not plan["sent"]
    if fire and plan["side"] == "before":
        plan["sent"] = True
        os.kill(os.getpid(), signal.SIGINT)  # its handler runs as os.kill returns: before the JVM sees this call
    answer = original_send(self, *args, **kwargs)
    if fire and plan["side"] == "after":
        plan["sent"] = True
        os.kill(os.getpid(), signal.SIGINT)  # its handler runs here: the caller never gets the answer
    return answer


def one_period(target: int, side: str) -> bool:
    """One quiet period with the ``target``-th call interrupted; whether KeyboardInterrupt came."""
    plan.update(active=True, count=0, target=target, side=side, sent=False)
    interrupted = False
    try:
        with quiet.quiet_spark_logs(spark):
            pass
    except KeyboardInterrupt:
        interrupted = True
    finally:
        plan["active"] = False
    return interrupted


client_class.send_command = send_command
assert quiet.wait_restored(30)
before = state()
one_period(0, "")
calls = plan["count"]
wrong: list[dict[str, Any]] = []
trials = interrupted = 0
for target in range(1, calls + 1):
    for side in ("before", "after"):
        trials += 1
        interrupted += one_period(target, side)
        restored = quiet.wait_restored(30)
        now = state()
        if not restored or now != before:
            wrong.append({"call": target, "side": side, "restored": restored, "now": repr(now)})
client_class.send_command = original_send
print(json.dumps({"calls": calls, "trials": trials, "interrupted": interrupted, "wrong": wrong}), flush=True)
spark.stop()
sys.exit(0)
