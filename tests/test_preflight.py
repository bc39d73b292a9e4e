"""Checks before anything starts: the executors' Python before the barrier stage
(driver/spark/preflight.py) and Java before an embedded session (driver/spark/java.py). Each problem is one
LaunchError line naming what was found and the fix, with no Java or Py4J trace; end to end in
subprocesses, so that everything the JVM prints is captured too."""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from spark_torch.driver.spark import preflight
from spark_torch.driver.spark.java import check_java, java_major, required_java
from spark_torch.driver.spark.preflight import ExecutorPython, describe_failure, describe_problem
from spark_torch.errors import LaunchError

from .conftest import SCRIPTS

REPO = Path(__file__).resolve().parent.parent
DRIVER = SCRIPTS / "preflight_driver.py"
#: what a JVM prints when it logs an exception: never in the output of these runs
JAVA_TRACE_MARKS = ("\tat org.apache", "\tat java.", "Lost task", "Exception in task", "py4j", "Py4J")


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1", PYTHONPATH=str(REPO), **extra)
    env.pop("PYSPARK_PYTHON", None)
    return env


def run_driver(master: str, executor_python: str, *how: str, **env: str) -> tuple[str, str, float]:
    """(stdout, stderr, seconds) of tests/scripts/preflight_driver.py."""
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(DRIVER), master, executor_python, *how],
        capture_output=True,
        text=True,
        timeout=240,
        env=child_env(**env),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout, done.stderr, time.monotonic() - started


def assert_no_trace(stderr: str) -> None:
    found = [mark for mark in JAVA_TRACE_MARKS if mark in stderr]
    assert not found, f"{found} in the driver's stderr:\n{stderr[-3000:]}"
    assert "Traceback" not in stderr, stderr[-3000:]


def error_line(stdout: str) -> str:
    lines = [line for line in stdout.splitlines() if line.startswith(("ERROR", "RESULT"))]
    assert len(lines) == 1, stdout
    return lines[0]


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory: Any) -> str:
    """A fresh venv of this Python with nothing installed (no psutil, torch, pyarrow...)."""
    root = tmp_path_factory.mktemp("bare") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120)
    return str(root / "bin" / "python")


@pytest.fixture(scope="module")
def older_python(tmp_path_factory: Any) -> str:
    """This Python, but saying it is one minor version older (so PySpark's worker refuses it)."""
    root = tmp_path_factory.mktemp("older")
    (root / "shadow").mkdir()
    (root / "shadow" / "sitecustomize.py").write_text(
        "import collections, sys\n"
        "_V = collections.namedtuple('version_info', 'major minor micro releaselevel serial')\n"
        "sys.version_info = _V(sys.version_info[0], sys.version_info[1] - 1, 0, 'final', 0)\n"
    )
    wrapper = root / "python"
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH="{root / "shadow"}:$PYTHONPATH" exec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


# --- the executors' Python, end to end --------------------------------------------------------


@pytest.mark.slow
def test_executors_without_the_dependencies_fail_before_the_barrier_stage(bare_python: str, tmp_path: Path) -> None:
    """A local-cluster whose executors run a bare venv: one line naming it, its version, what it
    lacks and the fix; the JVM prints no trace (the probe returns facts, it does not fail). The
    executors' Python takes longer to start than the probe's deadline (here 12 s against 4 s: a
    packed venv unpacking, a loaded machine): a probe whose tasks run is still waited for, so the
    check is made, not skipped (the run then failed later, importing cryptography). Its tasks are
    seen running at once, not at the executor's next heartbeat, when Spark's status store learns of
    them (it was 4-10 s later: the check was skipped)."""
    slow = tmp_path / "slow-python"
    slow.write_text(f'#!/bin/sh\nsleep 12\nexec {bare_python} "$@"\n')
    slow.chmod(0o755)
    # one executor JVM of two cores (two slots for the run's two ranks): one JVM fewer to start than two executors
    # the executor registered before the run: what is slow here is the Python alone
    stdout, stderr, _ = run_driver(
        "local-cluster[1,2,1024]", str(slow), PREFLIGHT_PROBE_SECONDS="4", PREFLIGHT_WAIT_SLOTS="2"
    )
    line = error_line(stdout)
    assert line.startswith(
        f"ERROR LaunchError: the executors' Python cannot run spark_torch: {bare_python} "
        f"(Python {platform.python_version()}, on "
    ), line
    assert "cannot import cloudpickle, cryptography, psutil, pyarrow, torch " in line
    assert f"(PYSPARK_PYTHON was {str(slow)!r} when the SparkContext started)" in line
    assert "starting the run unchecked" not in stderr
    assert "Point PYSPARK_PYTHON at a Python that has them" in line and "spark.archives=" in line
    assert "\nATTEMPTS launch failed\n" in stdout  # the check ended the run's one attempt, recorded
    assert_no_trace(stderr)


@pytest.mark.slow
def test_executor_pythons_that_pyspark_cannot_use_and_one_without_pandas_or_fsspec(
    older_python: str, hiding_python: str, tmp_path: Path
) -> None:
    """PySpark's worker refuses the executors' Python before the probe runs: the failure is still
    one line, and the scheduler's per-task traces are held back (local[2]: the executor's own
    'Exception in task' log is in this JVM). And what the README says executors need is what the
    check asks for: a run whose executors (and ranks) can import neither pandas nor fsspec
    succeeds (storage on a local path). Three cases, one session each in one driver process (one
    JVM to start): an older minor version, no such interpreter, then one without pandas and fsspec."""
    missing = str(tmp_path / "no" / "python")
    stdout, stderr, _ = run_driver(
        "local[2]", older_python, missing, hiding_python, SPARK_TORCH_TEST_HIDE="pandas,fsspec"
    )
    assert stdout.count("=== ") == 3 and f"=== {missing} ===\n" in stdout, stdout
    older, rest = stdout.split(f"=== {missing} ===\n")
    none, hiding = rest.split(f"=== {hiding_python} ===\n")
    major, minor = sys.version_info[:2]
    line = error_line(older)
    assert line.startswith(
        f"ERROR LaunchError: the executors run Python {major}.{minor - 1} and the driver Python {major}.{minor}; "
        f"PySpark needs the same major.minor version on both (PYSPARK_PYTHON was {older_python!r}"
    ), line
    assert f"Point PYSPARK_PYTHON at a Python {major}.{minor} before the SparkSession starts" in line
    line = error_line(none)
    assert line.startswith(f"ERROR LaunchError: the executors cannot start their Python {missing!r}: "), line
    assert "No such file or directory" in line
    assert error_line(hiding).startswith("RESULT "), stdout + stderr[-3000:]
    assert_no_trace(stderr)  # of all three sessions


@pytest.mark.slow
def test_cli_conf_spark_pyspark_python_reaches_the_executors(bare_python: str, tmp_path: Path) -> None:
    """``--conf spark.pyspark.python`` (which a session started in-process ignores by itself) is
    what the embedded session's executors run, and what the check names."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "spark_torch",
            "run",
            "--distributed",
            "--master",
            "local[2]",
            "--conf",
            f"spark.pyspark.python={bare_python}",
            "-n",
            "2",
            str(SCRIPTS / "env_dump.py"),
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=child_env(),
    )
    assert done.returncode == 1, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"spark-torch: error: the executors' Python cannot run spark_torch: {bare_python} "), last
    assert_no_trace(done.stderr)
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_builder_spark_pyspark_python_that_pyspark_ignored_is_named(bare_python: str) -> None:
    """``SparkSession.builder.config("spark.pyspark.python", GOOD)`` in the driver's own process:
    PySpark starts ``python3`` from PATH (here a bare venv's) instead; the error names the
    ignored setting and how to set it so that it counts."""
    path = f"{os.path.dirname(bare_python)}:{os.environ['PATH']}"
    stdout, stderr, _ = run_driver("local[2]", sys.executable, "builder", PATH=path)
    line = error_line(stdout)
    assert line.startswith("ERROR LaunchError: the executors' Python cannot run spark_torch: "), line
    assert "(PYSPARK_PYTHON was 'python3' when the SparkContext started; the session's " in line, line
    assert (
        f"spark.pyspark.python={sys.executable!r} was not used: PySpark reads that key only through spark-submit"
        in line
    )
    assert f"Set os.environ['PYSPARK_PYTHON'] = {sys.executable!r} before the session starts" in line
    assert_no_trace(stderr)


def test_too_few_slots_on_cpu_names_ranks_per_task(spark_session: Any, no_leftovers: None) -> None:
    """local[2] and 4 ranks on CPU: the error names ranks_per_task, in seconds; and that fix runs."""
    from spark_torch import AttemptEnd, Distributor, InsufficientSlotsError

    started = time.monotonic()
    d = Distributor(num_processes=4, local_mode=False, spark=spark_session)
    with pytest.raises(InsufficientSlotsError) as info:
        d.run(os.getpid)
    assert time.monotonic() - started < 10
    assert d.last_run is not None and [a.end for a in d.last_run.attempts] == [AttemptEnd.MISCONFIGURED]
    assert str(d.last_run.attempts[0].error).startswith("distributed mode needs 4 Spark task slots at once")
    assert "has 2. Use num_processes<=2" in str(info.value)
    assert "on CPU run several ranks in each task (ranks_per_task=K, a divisor of num_processes" in str(info.value)
    world = Distributor(num_processes=4, local_mode=False, spark=spark_session, ranks_per_task=2, log_ranks=[]).run(
        _world_size
    )
    assert world == 4


def _world_size() -> int:
    return int(os.environ["WORLD_SIZE"])


def test_readme_names_what_the_check_asks_for() -> None:
    """The README's one list of what executors need names every module the check imports or
    looks up there, fsspec only for a storage URL, and not pandas."""
    imported, found = preflight.node_modules(ship_package=True)
    needed = {name.split(".")[0] for name in imported + found}
    readme = (REPO / "README.md").read_text()
    paragraphs = [p for p in readme.split("\n\n") if "Executors** need" in p or p.startswith("Executors need")]
    paragraphs = [p.split("- **Executors**", 1)[-1].split("\n- ", 1)[0] for p in paragraphs]
    assert len(paragraphs) == 1, paragraphs  # one place
    for text in paragraphs:
        named = set(re.findall(r"[a-z_]+", text.replace("`", "")))
        assert needed <= named, (needed - named, text)
        assert "fsspec" in named and "storage_path" in text and "pandas<3" not in text, text


# --- the executors' Python, in this process ---------------------------------------------------


def test_probe_on_a_healthy_session_passes_and_is_remembered(spark_session: Any) -> None:
    facts = preflight._ask(spark_session, 2, *preflight.node_modules(ship_package=False))
    assert isinstance(facts, list) and len(facts) == 2
    assert {(f.executable, f.version, f.missing) for f in facts} == {(sys.executable, platform.python_version(), ())}
    preflight._passed.clear()
    preflight.check_executors(spark_session, 2, ship_package=True)
    assert preflight._executor_set(spark_session) in preflight._passed


def test_probe_reports_instead_of_raising(tmp_path: Path) -> None:
    """The executor side never raises: a module that is absent, one whose import fails."""
    (tmp_path / "broken_mod.py").write_text("raise OSError('libfoo.so: cannot open shared object file')\n")
    sys.path.insert(0, str(tmp_path))
    try:
        text = preflight._portable(preflight._probe)(("json", "broken_mod", "absent_mod.sub"), ("also_absent",), 0)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("broken_mod", None)
    import json

    facts = json.loads(text)
    assert dict(facts["missing"]) == {
        "absent_mod": "",
        "also_absent": "",
        "broken_mod": "OSError: libfoo.so: cannot open shared object file",
    }
    assert facts["executable"] == sys.executable


def test_probe_travels_by_value() -> None:
    """The executors may not have spark_torch: the pickled probe runs where it cannot be imported."""
    from pyspark import cloudpickle

    blob = cloudpickle.dumps(preflight._portable(preflight._probe))
    code = (
        "import json, pickle, sys\n"
        "sys.modules['spark_torch'] = None  # import spark_torch fails\n"
        "print(json.loads(pickle.loads(sys.stdin.buffer.read())(('json',), (), 0))['missing'])\n"
    )
    done = subprocess.run([sys.executable, "-c", code], input=blob, capture_output=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == b"[]", done.stderr


def test_problem_names_each_interpreter_once() -> None:
    bare = ExecutorPython("/usr/bin/python3", "3.11.2", "h1", (("psutil", ""), ("torch", "")))
    found = [
        bare,
        ExecutorPython("/usr/bin/python3", "3.11.2", "h2", bare.missing),
        ExecutorPython("/venv/bin/python", "3.11.2", "h3"),
    ]
    message = describe_problem(found, "python3", driver_python="/venv/bin/python")
    assert message is not None and "\n" not in message
    assert message.startswith(
        "the executors' Python cannot run spark_torch: /usr/bin/python3 (Python 3.11.2, on h1, h2) cannot import "
        "psutil, torch (PYSPARK_PYTHON was 'python3' when the SparkContext started). Point PYSPARK_PYTHON at a "
        "Python that has them before the SparkSession starts (this driver runs /venv/bin/python;"
    ), message
    assert describe_problem(found[2:], "python3") is None


def test_a_missing_module_of_the_run_leads_with_its_own_install_hint() -> None:
    """Replica groups need torchft on the executors: its hint comes first, once, and only when it is missing."""
    lacking = [ExecutorPython("/venv/bin/python", "3.11.2", "h1", (("torchft", ""),))]
    hints = {"torchft": "replica_groups needs torchft: pip install 'torchft>=0.2.0'", "other": "never shown"}
    message = describe_problem(lacking, None, driver_python="/venv/bin/python", hints=hints)
    assert message is not None and message.startswith(
        "the executors' Python cannot run spark_torch: /venv/bin/python (Python 3.11.2, on h1) cannot import torchft. "
        "replica_groups needs torchft: pip install 'torchft>=0.2.0'. Point PYSPARK_PYTHON at"
    ), message
    assert "never shown" not in message


@pytest.mark.parametrize(
    "text",
    [
        "[PYTHON_VERSION_MISMATCH] Python in worker has different version: 3.10 than that in driver: 3.11, PySpark",
        "Python in worker has different version (3, 10) than that in driver 3.11, PySpark cannot run",  # 3.5
    ],
)
def test_failure_version_mismatch_in_both_pyspark_wordings(text: str) -> None:
    message = describe_failure(RuntimeError(f"stage failed\n{text}\n\tat org.apache..."), None)
    assert message is not None and message.startswith("the executors run Python 3.10 and the driver Python 3.11; ")


def test_unknown_probe_failure_is_not_a_verdict() -> None:
    assert describe_failure(RuntimeError("ExecutorLostFailure (executor 1 exited)"), "python3") is None


# --- Java ------------------------------------------------------------------------------------


def fake_java(directory: Path, version: str) -> Path:
    """``directory/bin/java`` printing ``version`` the way ``java -version`` does."""
    (directory / "bin").mkdir(parents=True)
    java = directory / "bin" / "java"
    java.write_text(
        f"#!/bin/sh\necho 'openjdk version \"{version}\" 2019-01-15' >&2\necho 'OpenJDK Runtime Environment' >&2\n"
    )
    java.chmod(0o755)
    return java


@pytest.mark.parametrize(
    ("output", "expected"),
    [
        ('openjdk version "17.0.15" 2025-04-15', (17, "17.0.15")),
        ('Picked up JAVA_TOOL_OPTIONS: -Xss4m\njava version "1.8.0_292"', (8, "1.8.0_292")),
        ('openjdk version "21-ea" 2023-09-19', (21, "21-ea")),
        ("Error: could not find libjava.so", None),
    ],
)
def test_java_version_parsing(output: str, expected: tuple[int, str] | None) -> None:
    assert java_major(output) == expected


def test_required_java() -> None:
    assert (required_java("4.3.0"), required_java("3.5.2"), required_java("4.1.0.dev1")) == (17, 8, 17)


def test_check_java_in_process(tmp_path: Path) -> None:
    fake_java(tmp_path / "jdk11", "11.0.2")
    with pytest.raises(
        LaunchError,
        match=r"^PySpark 4\.3\.0 needs Java 17 or newer, but .*/jdk11/bin/java \(JAVA_HOME=.*\) is Java 11\.0\.2; install",
    ):
        check_java("4.3.0", {"JAVA_HOME": str(tmp_path / "jdk11"), "PATH": ""})
    check_java("3.5.2", {"JAVA_HOME": str(tmp_path / "jdk11"), "PATH": ""})  # 3.5 runs on 11
    with pytest.raises(LaunchError, match=r"and .*/nowhere/bin/java does not exist"):
        check_java("4.3.0", {"JAVA_HOME": str(tmp_path / "nowhere"), "PATH": ""})


JAVA_CASES = ["JAVA_HOME: Java 11", "PATH: Java 11", "no java"]


def java_env(case: str, tmp_path: Path) -> dict[str, str]:
    env = child_env()
    env.pop("JAVA_HOME", None)
    env.pop("PYSPARK_GATEWAY_PORT", None)
    if case == "JAVA_HOME: Java 11":
        fake_java(tmp_path / "jdk11", "11.0.2")
        env["JAVA_HOME"] = str(tmp_path / "jdk11")
    elif case == "PATH: Java 11":
        fake_java(tmp_path / "jdk11", "11.0.2")
        env["PATH"] = f"{tmp_path / 'jdk11' / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    else:
        (tmp_path / "empty").mkdir()
        env["PATH"] = str(tmp_path / "empty")
    return env


def assert_java_line(line: str, case: str, tmp_path: Path) -> None:
    import pyspark

    needed = f"PySpark {pyspark.__version__} needs Java {required_java(pyspark.__version__)} or newer, but "
    if case == "no java":
        assert needed + "there is none (JAVA_HOME is not set and no java is on PATH); install a JDK" in line, line
    else:
        where = f"JAVA_HOME={tmp_path / 'jdk11'}" if case.startswith("JAVA_HOME") else "on PATH; JAVA_HOME is not set"
        assert needed + f"{tmp_path / 'jdk11' / 'bin' / 'java'} ({where}) is Java 11.0.2; install a JDK" in line, line


@pytest.mark.parametrize("case", JAVA_CASES)
def test_distributor_run_without_a_usable_java(case: str, tmp_path: Path) -> None:
    code = (
        "from spark_torch import Distributor, LaunchError\n"
        "try:\n"
        "    Distributor(num_processes=2, local_mode=False).run(print)\n"
        "except LaunchError as exc:\n"
        "    print('ERROR', exc)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=java_env(case, tmp_path)
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ERROR ") and done.stdout.count("\n") == 1, done.stdout
    assert_java_line(done.stdout, case, tmp_path)
    assert "Traceback" not in done.stderr and "JAVA_GATEWAY_EXITED" not in done.stderr, done.stderr


@pytest.mark.parametrize("case", JAVA_CASES)
@pytest.mark.parametrize("command", ["run", "doctor"])
def test_cli_without_a_usable_java(command: str, case: str, tmp_path: Path) -> None:
    args = (
        ["run", "--distributed", "-n", "2", str(SCRIPTS / "env_dump.py"), str(tmp_path)]
        if command == "run"
        else ["doctor"]
    )
    done = subprocess.run(
        [sys.executable, "-m", "spark_torch", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=java_env(case, tmp_path),
    )
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("spark-torch: error: "), done.stderr
    assert_java_line(lines[0], case, tmp_path)
