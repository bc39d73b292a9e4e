"""The suite's own sessions (``tests/sessions.py``): a session has only its own settings, never those
of the session that launched the process's driver JVM."""

from __future__ import annotations

import json
import subprocess
import sys

from .conftest import SCRIPTS


def test_a_session_keeps_no_setting_of_the_session_that_launched_the_driver_jvm() -> None:
    """PySpark launches the driver JVM with the first session's settings, which spark-submit keeps as
    system properties that every later SparkConf reads: a 64m maxResultSize once failed a later
    local[2] test's 110 MiB result."""
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / "two_sessions.py")], capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr[-3000:]
    first, second = json.loads(done.stdout.strip().splitlines()[-1])
    assert first == {
        "spark.driver.maxResultSize": "64m",
        "spark.python.worker.reuse": "false",
        "spark.master": "local[1]",
    }
    assert second == {"spark.driver.maxResultSize": None, "spark.python.worker.reuse": None, "spark.master": "local[2]"}
