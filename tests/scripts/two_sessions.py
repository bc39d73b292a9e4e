"""Make two sessions one after another with ``tests/sessions.py`` in a new process (the first launches
the driver JVM with its settings) and print, as JSON, the settings each session's SparkContext has."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.sessions import make_session, stop_active  # noqa: E402

KEYS = ("spark.driver.maxResultSize", "spark.python.worker.reuse", "spark.master")
seen = []
for session in (
    lambda: make_session("local[1]", {"spark.python.worker.reuse": "false"}, spark_driver_maxResultSize="64m"),
    lambda: make_session("local[2]"),
):
    conf = session().sparkContext.getConf()
    seen.append({key: conf.get(key) for key in KEYS})
stop_active()
print(json.dumps(seen))
