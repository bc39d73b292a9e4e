"""Shared fixtures: real Spark sessions on loopback, environment restore, leftover checks.

Spark allows one SparkContext per process, so sessions are switched in a fixed order:
first pytest-spark's ``spark_session`` (``local[2]``), then the ``local-cluster`` sessions;
``pytest_collection_modifyitems`` moves the tests that need a cluster to the end.
"""

from __future__ import annotations

import glob
import os
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from .prebuild import TORCH_EXTENSIONS_DIR
from .session_tmp import make_session_tmp, sweep_ended_sessions

# Must be set before any SparkContext starts: executors run this interpreter, on loopback.
# A session marker and a private TMPDIR are inherited by every JVM, Python worker and rank this
# test session starts, so leftover checks never confuse them with another test session's.
SESSION_MARK = uuid.uuid4().hex
#: when this process began: the applications' directories made since are this run's (pytest_sessionfinish)
_RUN_STARTED = time.time()
os.environ["SPARK_TORCH_TEST_SESSION"] = SESSION_MARK
# pytest-xdist workers inherit the controller's TMPDIR: each makes its own beside it, not inside it
# (a nested one lengthens the warm-start templates' socket paths past AF_UNIX's 108 bytes)
_TMP_BASE = os.environ.setdefault("SPARK_TORCH_TEST_TMP_BASE", tempfile.gettempdir())
# (tests/session_tmp.py: the folders of test processes that have ended are removed here)
sweep_ended_sessions(_TMP_BASE)
_SESSION_TMP = make_session_tmp(_TMP_BASE)
os.environ["TMPDIR"] = _SESSION_TMP
# Spark's local dirs (where executors' Python workers, and so the node runners, keep scratch files)
os.environ["SPARK_LOCAL_DIRS"] = _SESSION_TMP
tempfile.tempdir = _SESSION_TMP
os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
os.environ["PYSPARK_PYTHON"] = sys.executable
os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
# DeepSpeed's CPU accelerator compiles an op on first use (tests/test_integrations.py) into
# TORCH_EXTENSIONS_DIR; torch guards that build with a lock file that a killed build leaves behind,
# and every later build waits on it forever. One cache per environment, not the user's shared
# ~/.cache, so a build killed elsewhere (another checkout, an interrupted session) cannot hang ours.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", TORCH_EXTENSIONS_DIR)  # made by make bootstrap
#: a build lock older than this was left by a build that was killed (the op builds in minutes)
STALE_BUILD_LOCK_SECONDS = 1800.0


def _clear_stale_build_locks(root: str, now: float) -> list[str]:
    """Remove the build locks under ``root`` that no build can still hold (older than
    ``STALE_BUILD_LOCK_SECONDS``): torch waits on such a lock forever. Returns what was removed."""
    removed = []
    for lock in glob.glob(os.path.join(root, "*", "lock")):
        try:
            if now - os.stat(lock).st_mtime > STALE_BUILD_LOCK_SECONDS:
                os.unlink(lock)
                removed.append(lock)
        except FileNotFoundError:  # another worker removed it, or the build ended
            continue
    return removed


for _lock in _clear_stale_build_locks(os.environ["TORCH_EXTENSIONS_DIR"], time.time()):
    print(f"conftest: removed {_lock}, left by a torch extension build that was killed", file=sys.stderr)
import pyspark  # noqa: E402

os.environ.setdefault("SPARK_HOME", os.path.dirname(pyspark.__file__))
# every JVM the tests start maps Spark's classes from one archive made once per environment
# (tests/jvm_archive.py: a driver starts in ~4 s instead of ~10 s on 2 cores); the drivers and
# standalone daemons take the options from the environment, the executors from make_session
from tests import jvm_archive, sessions  # noqa: E402
from tests.other_user import open_folder  # noqa: E402
from tests.sessions import stop_active, wait_for_slots  # noqa: E402, F401

EXECUTOR_JAVA_OPTIONS = jvm_archive.install() if os.environ.get("SPARK_TORCH_TEST_JVM_ARCHIVE", "1") != "0" else ""

TESTS = Path(__file__).parent
SCRIPTS = TESTS / "scripts"
CLUSTER_MASTER = "local-cluster[2,1,1024]"

# Fixture names that own a SparkContext, in the order their tests run (one context at a time).
_ORDER = {
    "spark_session": 1,
    "local4_spark": 1.5,
    "plain_local_spark": 2,
    "cluster_spark": 3,
    "cluster3_spark": 3.5,
    "gpu_cluster_spark": 4,
    "gpu_local_spark": 5,
    "standalone_spark": 6,
    "two_host_spark": 7,
    "no_psutil_spark": 8,
    "stale_executors_spark": 8.5,
    "connect_spark": 9,  # last: after a Connect session, the classic builder asks for a remote URL
}


def _session_kind(item: Any) -> str | None:
    """The session fixture with the highest order among those ``item`` uses (None: no Spark, or pytest-spark's)."""
    names = [n for n in getattr(item, "fixturenames", ()) if n in _ORDER]
    return max(names, key=_ORDER.__getitem__) if names else None


def pytest_xdist_make_scheduler(config: Any, log: Any) -> Any:
    """How ``make test`` deals the tests out to its workers: ``tests/scheduling.py``."""
    from .scheduling import make_scheduler

    return make_scheduler(config, log)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    """Run tests ordered by the Spark session they need, so each session starts once (per worker)."""

    def weight(item: Any) -> float:
        kind = _session_kind(item)
        return _ORDER[kind] if kind else 0

    items.sort(key=weight)
    for item in items:
        if Path(str(item.fspath)).parent == TESTS / "unit":
            item.add_marker(pytest.mark.unit)


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    """The controller removes the local-cluster applications' directories this run left in
    ``$SPARK_HOME/work`` (``tests/spark_work.py``)."""
    if hasattr(session.config, "workerinput"):
        return
    from .spark_work import remove_finished_applications, work_root

    _, kept = remove_finished_applications(work_root(), since=_RUN_STARTED)
    for app in kept:
        print(f"conftest: {app} is still in use, left in place", file=sys.stderr)


def pytest_runtest_logreport(report: Any) -> None:
    """With ``SPARK_TORCH_TEST_FAILURES=FILE``, each failure is appended to FILE as it happens (a
    long parallel run can be read, or stopped, before its summary)."""
    path = os.environ.get("SPARK_TORCH_TEST_FAILURES")
    if path and report.failed and "PYTEST_XDIST_WORKER" not in os.environ:  # once: the controller sees all
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(f"===== {report.nodeid} ({report.when}, {report.duration:.1f}s)\n{report.longreprtext[-4000:]}\n")


def make_session(master: str, conf: dict[str, str] | None = None, **underscored: str) -> Any:
    """A fresh session on ``master`` (``tests/sessions.py``) whose executors use the suite's JVM archive."""
    return sessions.make_session(master, conf, executor_java_options=EXECUTOR_JAVA_OPTIONS, **underscored)


#: the session each fixture kind made in this process, while it is still the active one
_MADE: dict[str, Any] = {}


def _ensure(kind: str, start: Callable[[], Any]) -> Any:
    """The session (or value holding it first) of fixture ``kind``: the one made earlier while it is
    still the process's SparkContext, else a new one from ``start`` (which stops any other first:
    one SparkContext per process). Workers run the kinds in ``_ORDER``, so a kind starts once per
    worker; a group that mixes kinds (a file's module fixtures) still gets the session it asks for."""
    from pyspark import SparkContext

    made = _MADE.get(kind)
    session = made[0] if isinstance(made, tuple) else made
    if session is not None and SparkContext._active_spark_context is session.sparkContext:
        return made
    _MADE.clear()
    made = start()
    _MADE[kind] = made
    return made


def _driver_jvm() -> Any:
    """The Popen of this process's Spark driver JVM (PySpark's gateway), or None."""
    from pyspark import SparkContext

    return getattr(SparkContext._gateway, "proc", None)


def _forget_dead_driver_jvm() -> None:
    """Let the next session start a new driver JVM: PySpark keeps its gateway for the process's
    life and would send every later command to the dead one."""
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    _MADE.clear()
    SparkContext._gateway = None
    SparkContext._jvm = None
    SparkContext._active_spark_context = None
    SparkSession._instantiatedSession = None
    SparkSession._activeSession = None
    sessions.forget_launch_settings()


@pytest.fixture(autouse=True)
def _driver_jvm_survives() -> Iterator[None]:
    """A test that ends this process's Spark driver JVM fails by name, with the JVM's exit status,
    and the tests after it get a new JVM instead of failing one by one on a dead gateway (a
    template loop's sweep once SIGKILLed it: 172 tests failed after the one that did it)."""
    jvm = _driver_jvm()
    yield
    if jvm is None or jvm.poll() is None:
        return
    _forget_dead_driver_jvm()
    pytest.fail(
        f"the Spark driver JVM of this process (pid {jvm.pid}) ended during this test with exit status "
        f"{jvm.returncode} (negative: killed by that signal); the next session starts a new one"
    )


@pytest.fixture(scope="session", autouse=True)
def _stop_sessions_at_the_end() -> Iterator[None]:
    """The last session of this process is stopped when the tests end."""
    yield
    _MADE.clear()
    stop_active()


@pytest.fixture
def spark_session() -> Any:
    """``local[2]`` with the ``spark_options`` of pyproject.toml (replaces pytest-spark's session-scoped
    fixture of that name, so that it is there again after another session ran in this process)."""

    def start() -> Any:
        from pytest_spark.util import reduce_logging

        spark = make_session("local[2]", {"spark.executor.instances": "1"})
        reduce_logging(spark.sparkContext)
        return spark

    return _ensure("spark_session", start)


@pytest.fixture
def local4_spark() -> Any:
    """A ``local[4]`` session: four task slots in the driver's JVM (two barrier jobs of two tasks at once)."""

    def start() -> Any:
        return make_session("local[4]")

    return _ensure("local4_spark", start)


@pytest.fixture
def plain_local_spark() -> Any:
    """A ``local`` (one slot, no brackets) session."""

    def start() -> Any:
        spark = make_session("local")
        return spark

    return _ensure("plain_local_spark", start)


@pytest.fixture
def cluster_spark() -> Any:
    """A ``local-cluster[2,1,1024]`` session: two executor JVMs with one core each (64m max result)."""

    def start() -> Any:
        spark = make_session(CLUSTER_MASTER, **{"spark_driver_maxResultSize": "64m"})
        wait_for_slots(spark, 2)
        return spark

    return _ensure("cluster_spark", start)


@pytest.fixture
def cluster3_spark() -> Any:
    """A ``local-cluster[3,1,1024]`` session: three 1-core executor JVMs (elastic runs lose one)."""

    def start() -> Any:
        spark = make_session("local-cluster[3,1,1024]")
        wait_for_slots(spark, 3)
        return spark

    return _ensure("cluster3_spark", start)


@pytest.fixture(scope="session")
def gpu_discovery_script(tmp_path_factory: Any) -> str:
    """A Spark GPU discovery script reporting two fake GPUs."""
    path = tmp_path_factory.mktemp("gpu") / "discover_gpus.sh"
    path.write_text('#!/bin/sh\necho \'{"name": "gpu", "addresses": ["0", "1"]}\'\n')
    path.chmod(0o755)
    return str(path)


@pytest.fixture
def gpu_cluster_spark(gpu_discovery_script: str) -> Any:
    """``local-cluster`` with 2 executors x 2 fake GPUs, 2 GPUs per task, CUDA_VISIBLE_DEVICES=4,6 on executors."""

    def start() -> Any:
        spark = make_session(
            "local-cluster[2,2,1024]",
            {
                "spark.executor.cores": "2",
                "spark.task.cpus": "2",
                "spark.worker.resource.gpu.amount": "2",
                "spark.worker.resource.gpu.discoveryScript": gpu_discovery_script,
                "spark.executor.resource.gpu.amount": "2",
                "spark.executor.resource.gpu.discoveryScript": gpu_discovery_script,
                "spark.task.resource.gpu.amount": "2",
                # executors that already restrict CUDA: Spark's addresses are positions in this list
                "spark.executorEnv.CUDA_VISIBLE_DEVICES": "4,6",
            },
        )
        wait_for_slots(spark, 2)
        return spark

    return _ensure("gpu_cluster_spark", start)


@pytest.fixture
def gpu_local_spark(gpu_discovery_script: str) -> Any:
    """``local[2]`` whose driver owns two fake GPUs."""

    def start() -> Any:
        spark = make_session(
            "local[2]",
            {
                "spark.driver.resource.gpu.amount": "2",
                "spark.driver.resource.gpu.discoveryScript": gpu_discovery_script,
            },
        )
        return spark

    return _ensure("gpu_local_spark", start)


@pytest.fixture
def no_psutil_spark(tmp_path_factory: Any) -> Any:
    """``local[2]`` whose executors' Python cannot import psutil (a dependency of spark_torch):
    the Python workers run through a wrapper that puts a failing ``psutil`` first on the path."""

    def start() -> Any:
        root = tmp_path_factory.mktemp("no_psutil")
        (root / "shadow" / "psutil").mkdir(parents=True)
        (root / "shadow" / "psutil" / "__init__.py").write_text(
            "raise ModuleNotFoundError(\"No module named 'psutil'\", name='psutil')\n"
        )
        wrapper = root / "python"
        wrapper.write_text(f'#!/bin/sh\nPYTHONPATH="{root / "shadow"}:$PYTHONPATH" exec {sys.executable} "$@"\n')
        wrapper.chmod(0o755)
        os.environ["PYSPARK_PYTHON"] = str(wrapper)  # read once, when the context starts
        try:
            spark = make_session("local[2]")
        finally:
            os.environ["PYSPARK_PYTHON"] = sys.executable
        return spark

    return _ensure("no_psutil_spark", start)


#: the shadow package of ``stale_executors_spark`` says "not installed" while this file exists
MISSING_FLAG = "spark_torch_missing"


@pytest.fixture
def stale_executors_spark(tmp_path_factory: Any) -> tuple[Any, Path]:
    """``local-cluster[2,1,1024]`` whose executors' Python finds another spark_torch first: a copy
    of this one that says it is version 0.0.9, or, while ``FLAG_DIR/spark_torch_missing``
    exists, "No module named 'spark_torch'" (an executor without it). Python workers are not
    reused, so every task imports afresh. Yields the session and FLAG_DIR."""

    def start() -> tuple[Any, Path]:
        import shutil

        root = tmp_path_factory.mktemp("stale")
        shadow = root / "shadow" / "spark_torch"
        shutil.copytree(
            Path(__file__).resolve().parent.parent / "spark_torch", shadow, ignore=shutil.ignore_patterns("__pycache__")
        )
        (shadow / "version.py").write_text(
            (shadow / "version.py").read_text().replace('__version__ = "0.1.0"', '__version__ = "0.0.9"')
        )
        init = (shadow / "__init__.py").read_text()
        (shadow / "__init__.py").write_text(
            "import os as _os\n"
            f"if _os.path.exists({str(root / MISSING_FLAG)!r}):\n"
            "    raise ModuleNotFoundError(\"No module named 'spark_torch'\", name='spark_torch')\n" + init
        )
        wrapper = root / "python"
        wrapper.write_text(f'#!/bin/sh\nPYTHONPATH="{root / "shadow"}:$PYTHONPATH" exec {sys.executable} "$@"\n')
        wrapper.chmod(0o755)
        os.environ["PYSPARK_PYTHON"] = str(wrapper)  # read once, when the context starts
        try:
            spark = make_session(CLUSTER_MASTER, {"spark.python.worker.reuse": "false"})
        finally:
            os.environ["PYSPARK_PYTHON"] = sys.executable
        wait_for_slots(spark, 2)
        return spark, root

    return _ensure("stale_executors_spark", start)


@pytest.fixture
def fake_nvidia_smi(tmp_path: Path) -> str:
    """An ``nvidia-smi`` on PATH that lists two GPUs (for local mode without Spark's GPU resources)."""
    bin_dir = tmp_path / "fake-bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text(
        '#!/bin/sh\n[ "$1" = "-L" ] || exit 2\n'
        'echo "GPU 0: Fake GPU (UUID: GPU-00000000-0000-0000-0000-000000000000)"\n'
        'echo "GPU 1: Fake GPU (UUID: GPU-11111111-1111-1111-1111-111111111111)"\n'
    )
    smi.chmod(0o755)
    os.environ["PATH"] = f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"
    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    return str(smi)


@pytest.fixture(autouse=True)
def _restore_environ() -> Iterator[None]:
    """Tests may touch os.environ; the next test sees the original."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def rank_processes() -> list[psutil.Process]:
    """Rank processes of this test session: started cold they carry SPARK_TORCH_RUN_ID and our
    marker in their environment; forked from a warm-start template (whose environment they
    show) they are that template's children."""
    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            env = proc.environ()
            if env.get("SPARK_TORCH_TEST_SESSION") != SESSION_MARK:
                continue
            if "SPARK_TORCH_RUN_ID" in env:
                found.append(proc)
            elif "spark_torch.node.template.server" in " ".join(proc.cmdline()):
                found.extend(c for c in proc.children() if c.status() != psutil.STATUS_ZOMBIE)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def run_temp_dirs() -> list[str]:
    """Scratch directories of this session's runs (spark-torch-<run id>-node*): in the session's
    temp dir, or one level down in a Spark local dir (blockmgr-*) of an executor."""
    return glob.glob(os.path.join(_SESSION_TMP, "spark-torch-*")) + glob.glob(
        os.path.join(_SESSION_TMP, "*", "spark-torch-*")
    )


def session_executors() -> list[psutil.Process]:
    """Executor JVMs started by this test session's local-cluster."""
    found = []
    for proc in psutil.Process().children(recursive=True):
        try:
            if "CoarseGrainedExecutorBackend" in " ".join(proc.cmdline()):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


@pytest.fixture
def no_leftovers() -> Iterator[None]:
    """Assert that after the test no rank process and no run temp dir remain (bounded wait)."""
    before_dirs = set(run_temp_dirs())
    yield
    deadline = time.monotonic() + 15.0
    while True:
        procs = rank_processes()
        dirs = set(run_temp_dirs()) - before_dirs
        if not procs and not dirs:
            return
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
    details = [f"pid {p.pid}: {' '.join(p.cmdline())}" for p in procs if p.is_running()]
    pytest.fail(f"left behind: processes {details}, temp dirs {sorted(dirs)}")


@pytest.fixture
def channels(monkeypatch: Any) -> list[Any]:
    """Every DriverChannel a distributed run opens in this test, in order (to look at what
    arrived over the channel, not only at what the user got)."""
    import spark_torch.driver.run.barrier as barrier
    from spark_torch.channel.driver_end import DriverChannel

    opened: list[DriverChannel] = []

    class Recorded(DriverChannel):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            opened.append(self)

    monkeypatch.setattr(barrier, "DriverChannel", Recorded)
    return opened


@pytest.fixture(scope="session")
def hiding_python(tmp_path_factory: Any) -> str:
    """This Python as an executor would be without the top-level modules named in the
    SPARK_TORCH_TEST_HIDE variable of its environment (spark_torch from the driver's shipped
    zip excepted): a wrapper that puts ``scripts/hide_modules.py`` first as sitecustomize."""
    root = tmp_path_factory.mktemp("hiding")
    (root / "shadow").mkdir()
    (root / "shadow" / "sitecustomize.py").write_text((SCRIPTS / "hide_modules.py").read_text())
    wrapper = root / "python"
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH="{root / "shadow"}:$PYTHONPATH" exec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


@pytest.fixture
def open_base() -> Iterator[Path]:
    """A storage folder every user may write to (``0777``, no sticky bit: ``/tmp``-like, or
    ``~/spark_torch_runs`` made under ``umask 000``) where another user (tests/other_user.py)
    plants things; removed afterwards."""
    base = Path(open_folder())
    yield base
    shutil.rmtree(base)


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """This user's own private file, that a planted link points at."""
    path = tmp_path / "victim.txt"
    path.write_text("mine\n")
    path.chmod(0o600)
    return path
