"""The embedded session spark_torch starts: quiet (no JVM start-up notices, Spark's WARN lines
kept), on loopback when the user chose no address, and the user's own choices left alone."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from spark_torch.driver.spark.session import JVM_START_NOISE, embedded_conf

ROOT = Path(__file__).resolve().parent.parent

_PROBE = textwrap.dedent(
    """
    import json, os
    from spark_torch import Distributor

    def diff(before):
        after = dict(os.environ)
        return {"added": sorted(set(after) - set(before)), "removed": sorted(set(before) - set(after)),
                "changed": sorted(k for k in set(before) & set(after) if before[k] != after[k])}

    def one():
        return 1

    def hello():
        print("hello from rank", os.environ["RANK"], flush=True)
        return 1

    before = dict(os.environ)
    Distributor(num_processes=2, local_mode=True, log_ranks=[]).run(one)
    print("local", json.dumps(diff(before)), flush=True)
    before = dict(os.environ)
    Distributor(num_processes=2, local_mode=False, log_ranks=[]).run(one)  # starts the embedded session
    print("first distributed", json.dumps(diff(before)), flush=True)
    before = dict(os.environ)
    print("run", Distributor(num_processes=2, local_mode=False).run(hello), flush=True)
    print("second distributed", json.dumps(diff(before)), flush=True)

    from spark_torch.driver.spark.session import get_or_create_session

    spark = get_or_create_session()
    conf = spark.sparkContext.getConf()
    print("driver", conf.get("spark.driver.host"), conf.get("spark.driver.bindAddress"), flush=True)
    print("rows", spark.range(7).count(), flush=True)
    print("environment restored", "SPARK_LOCAL_IP" not in os.environ, flush=True)
    jvm = spark.sparkContext._jvm
    jvm.org.apache.logging.log4j.LogManager.getLogger("spark_torch.probe").warn("a real problem after start-up")
    spark.stop()
    """
)


def test_a_new_users_first_runs_start_the_session_quietly_on_loopback_and_leave_the_environment() -> None:
    """A new user's first runs (one driver process, one JVM): no SPARK_LOCAL_IP, no log4j
    configuration. The first distributed run starts the embedded session, which binds 127.0.0.1
    by itself and prints none of the JVM's start-up lines; the runs make Spark log no WARN, and
    Spark's WARN lines after start-up still reach stderr. README and docs/concepts.md: a run
    leaves os.environ as it found it, except the two variables PySpark's SparkContext itself adds
    when the embedded session starts."""
    # the suite's SPARK_* variables are gone but the JVM's quick-start options (no log4j in them)
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("SPARK_") or k in ("SPARK_HOME", "SPARK_SUBMIT_OPTS")
    }
    env.pop("PYSPARK_SUBMIT_ARGS", None)
    env.update(PYTHONPATH=str(ROOT), PYSPARK_PYTHON=sys.executable)
    done = subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=240, cwd=ROOT
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    nothing = '{"added": [], "removed": [], "changed": []}'
    lines = [line for line in done.stdout.splitlines() if line.startswith(("local ", "first ", "second "))]
    assert lines == [
        f"local {nothing}",
        'first distributed {"added": ["SPARK_AUTH_SOCKET_TIMEOUT", "SPARK_BUFFER_SIZE"], "removed": [], "changed": []}',
        f"second distributed {nothing}",
    ], output
    for page in (ROOT / "README.md", ROOT / "docs" / "concepts.md"):
        text = " ".join(page.read_text(encoding="utf-8").split())
        assert "PySpark's `SparkContext` adds `SPARK_AUTH_SOCKET_TIMEOUT` and `SPARK_BUFFER_SIZE`" in text, page
    assert "driver 127.0.0.1 127.0.0.1" in done.stdout and "rows 7" in done.stdout, output
    assert "environment restored True" in done.stdout
    assert "WARN probe: a real problem after start-up" in done.stderr, output
    assert "[rank 1] hello from rank 1" in done.stdout and "run 1" in done.stdout, output
    # the runs log no WARN of Spark's (the web UI's port may be taken on a shared machine)
    warns = [
        line
        for line in done.stderr.splitlines()
        if " WARN " in line and "probe" not in line and "could not bind" not in line
    ]
    assert not warns, warns
    noise = [
        line for line in output.splitlines() if any(n in line for n in JVM_START_NOISE) or "SPARK_LOCAL_IP" in line
    ]
    assert not noise, f"start-up noise: {noise}"


def test_quiet_log4j_only_without_the_users_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPARK_CONF_DIR", str(tmp_path))
    monkeypatch.delenv("LOG4J_CONFIGURATION_FILE", raising=False)
    environ: dict[str, str] = {}
    quiet = embedded_conf("local[2]", {}, environ)["spark.driver.extraJavaOptions"]
    assert quiet.startswith("-Dlog4j2.configurationFile=file:") and Path(quiet.split("file:", 1)[1]).is_file()
    # the user's Java options are kept, the quiet configuration added after them
    added = embedded_conf("local[2]", {"spark.driver.extraJavaOptions": "-Xss4m"}, environ)
    assert added["spark.driver.extraJavaOptions"] == f"-Xss4m {quiet}"
    # the user's log4j configuration wins, however it is given
    own = {"spark.driver.extraJavaOptions": "-Dlog4j2.configurationFile=/etc/mine.xml"}
    assert (
        embedded_conf("local[2]", own, environ)["spark.driver.extraJavaOptions"] == own["spark.driver.extraJavaOptions"]
    )
    assert "spark.driver.extraJavaOptions" not in embedded_conf("local[2]", {}, {"LOG4J_CONFIGURATION_FILE": "/x"})
    assert "spark.driver.extraJavaOptions" not in embedded_conf("local[2]", {}, {"SPARK_SUBMIT_OPTS": "-Dlog4j.debug"})
    (tmp_path / "spark-defaults.conf").write_text("spark.driver.extraJavaOptions -Dfoo=1\n")
    assert "spark.driver.extraJavaOptions" not in embedded_conf("local[2]", {}, environ)  # ours would replace theirs
    (tmp_path / "spark-defaults.conf").unlink()
    (tmp_path / "log4j2.properties").write_text("rootLogger.level = info\n")
    assert "spark.driver.extraJavaOptions" not in embedded_conf("local[2]", {}, environ)


def test_loopback_only_for_a_local_master_without_an_address(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPARK_CONF_DIR", str(tmp_path))
    loopback = {"spark.driver.host": "127.0.0.1", "spark.driver.bindAddress": "127.0.0.1"}
    for master in ("local", "local[*]", "local[2]", "local[2,3]"):
        conf = embedded_conf(master, {}, {})
        assert {k: conf[k] for k in loopback} == loopback
    assert "spark.driver.host" not in embedded_conf("local[*]", {}, {"SPARK_LOCAL_IP": "10.1.2.3"})
    assert embedded_conf("local[*]", {"spark.driver.host": "h"}, {})["spark.driver.host"] == "h"
    assert "spark.driver.host" not in embedded_conf("local[*]", {"spark.driver.bindAddress": "0.0.0.0"}, {})
    assert "spark.driver.host" not in embedded_conf("spark://master:7077", {}, {})
    assert "spark.driver.host" not in embedded_conf("local-cluster[2,1,1024]", {}, {})
