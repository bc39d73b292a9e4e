"""Helpers for tests on a real Spark standalone cluster (master + workers from the installed pyspark).

Every daemon is ``$SPARK_HOME/bin/spark-class <Master|Worker> ...`` started in its own process
group (optionally behind a prefix such as ``ip netns exec NS``, which execs in place), with its
console log in a file. Ports are ephemeral (``--port 0``, ``--webui-port 0``, the master's REST
server off); the master's actual URL is parsed from its log. :func:`stop_daemons` terminates the
groups and waits until every process a daemon started (executors, Python workers) is gone.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pyspark

SPARK_HOME = os.environ.get("SPARK_HOME") or os.path.dirname(pyspark.__file__)
SPARK_CLASS = os.path.join(SPARK_HOME, "bin", "spark-class")
SPARK_SUBMIT = os.path.join(SPARK_HOME, "bin", "spark-submit")
MASTER_CLASS = "org.apache.spark.deploy.master.Master"
WORKER_CLASS = "org.apache.spark.deploy.worker.Worker"

#: bound on a daemon's start (JVM start on a loaded 2-core machine takes a few seconds)
START_SECONDS = 120.0
#: how long a terminated daemon group gets before SIGKILL
STOP_SECONDS = 20.0

_MASTER_URL = re.compile(r"Starting Spark master at (spark://\S+)")
_LEADER = re.compile(r"I have been elected leader")
_WORKER_REGISTERED = re.compile(r"Registering worker (\S+) with")


@dataclass
class Daemon:
    """One spark-class JVM (its pid is the process-group id)."""

    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    def text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.text().splitlines()[-lines:])


@dataclass
class StandaloneCluster:
    """A running master and its workers."""

    url: str
    master: Daemon
    workers: list[Daemon] = field(default_factory=list)
    work_dirs: list[Path] = field(default_factory=list)

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def daemons(self) -> list[Daemon]:
        return [*self.workers, self.master]


def daemon_env(host: str, log_dir: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for a daemon bound to ``host``: small heaps, no REST server, our Python."""
    env = dict(os.environ)
    env.update(
        {
            "SPARK_HOME": SPARK_HOME,
            "SPARK_LOCAL_IP": host,
            "SPARK_LOG_DIR": str(log_dir),
            "SPARK_PID_DIR": str(log_dir),
            "SPARK_DAEMON_MEMORY": "256m",
            # the REST submission server would bind the fixed port 6066
            "SPARK_MASTER_OPTS": "-Dspark.master.rest.enabled=false",
            "PYSPARK_PYTHON": sys.executable,
            "PYSPARK_DRIVER_PYTHON": sys.executable,
        }
    )
    env.pop("SPARK_CONF_DIR", None)
    if extra:
        env.update(extra)
    return env


def start_daemon(name: str, args: Sequence[str], log_dir: Path, host: str, prefix: Sequence[str] = ()) -> Daemon:
    """Start ``spark-class args`` in a new process group, its output in ``log_dir/name.log``."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"{name}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [*prefix, SPARK_CLASS, *args],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=daemon_env(host, log_dir),
            start_new_session=True,
        )
    return Daemon(name, proc, log)


def wait_for_log(
    daemon: Daemon, pattern: re.Pattern[str], count: int = 1, seconds: float = START_SECONDS
) -> list[re.Match[str]]:
    """Poll the daemon's log until ``pattern`` matched ``count`` times (bounded)."""
    deadline = time.monotonic() + seconds
    while True:
        matches = list(pattern.finditer(daemon.text()))
        if len(matches) >= count:
            return matches
        if daemon.proc.poll() is not None:
            raise RuntimeError(
                f"{daemon.name} exited with {daemon.proc.returncode} before logging "
                f"{pattern.pattern!r} x{count}:\n{daemon.tail()}"
            )
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"{daemon.name} did not log {pattern.pattern!r} x{count} within {seconds:g}s:\n{daemon.tail()}"
            )
        time.sleep(0.2)


def start_master(log_dir: Path, host: str = "127.0.0.1", prefix: Sequence[str] = ()) -> tuple[Daemon, str]:
    """Start a master on ephemeral ports; return it and its ``spark://host:port`` URL once ALIVE."""
    master = start_daemon(
        "master", [MASTER_CLASS, "--host", host, "--port", "0", "--webui-port", "0"], log_dir, host, prefix
    )
    try:
        url = wait_for_log(master, _MASTER_URL)[0].group(1)
        wait_for_log(master, _LEADER)
    except BaseException:
        stop_daemons([master])
        raise
    return master, url


def start_worker(
    name: str,
    master_url: str,
    work_dir: Path,
    log_dir: Path,
    host: str = "127.0.0.1",
    cores: int = 1,
    memory: str = "1g",
    prefix: Sequence[str] = (),
) -> Daemon:
    """Start a worker registering with ``master_url`` (registration is awaited separately)."""
    work_dir.mkdir(parents=True, exist_ok=True)
    args = [
        WORKER_CLASS,
        "--host",
        host,
        "--port",
        "0",
        "--webui-port",
        "0",
        "--cores",
        str(cores),
        "--memory",
        memory,
        "--work-dir",
        str(work_dir),
        master_url,
    ]
    return start_daemon(name, args, log_dir, host, prefix)


def wait_for_workers(master: Daemon, count: int, seconds: float = START_SECONDS) -> list[str]:
    """Block until ``count`` workers registered with the master (from its log); their addresses."""
    return [m.group(1) for m in wait_for_log(master, _WORKER_REGISTERED, count, seconds)]


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover - someone else's group reusing the id
        return False
    return True


def stop_daemons(daemons: Sequence[Daemon], seconds: float = STOP_SECONDS) -> list[str]:
    """Terminate each daemon's process group (workers first), then SIGKILL what is left.

    Returns a description of the processes that needed SIGKILL (empty when all exited on SIGTERM).
    Every descendant seen before the kill (executor JVMs, Python workers in their own groups)
    is waited for as well.
    """
    tracked: list[psutil.Process] = []
    for daemon in daemons:
        try:
            root = psutil.Process(daemon.proc.pid)
            tracked += [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
    for daemon in daemons:
        if daemon.proc.poll() is None:
            try:
                os.killpg(daemon.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    _gone, alive = psutil.wait_procs(tracked, timeout=seconds)
    killed = []
    for proc in alive:
        try:
            killed.append(f"pid {proc.pid}: {' '.join(proc.cmdline())[:200]}")
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    for daemon in daemons:
        if _group_alive(daemon.proc.pid):
            try:
                os.killpg(daemon.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    psutil.wait_procs(alive, timeout=5)
    for daemon in daemons:
        try:
            daemon.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:  # pragma: no cover
            pass
    return killed


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def leftover_processes(daemons: Sequence[Daemon], dirs: Sequence[Path] = ()) -> list[str]:
    """Live processes in the daemons' process groups or mentioning one of ``dirs`` (work dirs)."""
    pgids = {d.proc.pid for d in daemons}
    needles = [str(p) for p in dirs]
    found = []
    for proc in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            cmd = " ".join(proc.info["cmdline"] or [])
            if os.getpgid(proc.pid) in pgids or any(d in cmd for d in needles):
                found.append(f"pid {proc.pid}: {cmd[:200]}")
        except (psutil.NoSuchProcess, ProcessLookupError, psutil.AccessDenied):
            continue
    return found


@contextmanager
def standalone_cluster(
    base: Path,
    *,
    workers: int = 2,
    host: str = "127.0.0.1",
    cores: int = 1,
    memory: str = "1g",
) -> Iterator[StandaloneCluster]:
    """A master and ``workers`` workers on ``host``; everything is stopped on exit."""
    logs = base / "logs"
    master, url = start_master(logs, host)
    cluster = StandaloneCluster(url, master)
    try:
        for i in range(workers):
            work = base / f"work-{i}"
            cluster.work_dirs.append(work)
            cluster.workers.append(start_worker(f"worker-{i}", url, work, logs, host, cores, memory))
        wait_for_workers(master, workers)
        yield cluster
    finally:
        stop_daemons(cluster.daemons())


def submit(
    args: Sequence[str],
    *,
    host: str = "127.0.0.1",
    prefix: Sequence[str] = (),
    timeout: float = 240.0,
    cwd: str | os.PathLike[str] | None = None,
    extra_env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``spark-submit args`` to completion (stdout and stderr merged) with our Python."""
    env = daemon_env(host, Path(cwd or os.getcwd()))
    for key in ("SPARK_MASTER_OPTS", "SPARK_DAEMON_MEMORY", "SPARK_LOG_DIR", "SPARK_PID_DIR"):
        env.pop(key, None)
    env.update(extra_env or {})
    proc = subprocess.Popen(
        [*prefix, SPARK_SUBMIT, *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=cwd,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid)
        out, _ = proc.communicate()
        raise AssertionError(f"spark-submit {' '.join(args)} did not finish in {timeout:g}s:\n{out[-5000:]}") from None
    except BaseException:
        _kill_group(proc.pid)
        proc.wait()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")


def check_submit_output(returncode: int, out: str, master_addr: str | None = "127.0.0.1") -> list[dict[str, Any]]:
    """Exit 0, ``RESULT 3``, both ranks' prefixed log lines, and the ranks' environment."""
    assert returncode == 0, out[-8000:]
    lines = out.splitlines()
    assert "RESULT 3" in lines, out[-8000:]
    for rank in (0, 1):
        assert any(line.startswith(f"[rank {rank}] all_reduce sum=3") for line in lines), out[-8000:]
    ranks = json.loads(next(line for line in lines if line.startswith("RANKS "))[len("RANKS ") :])
    assert [r["RANK"] for r in ranks] == ["0", "1"] and [r["NODE_RANK"] for r in ranks] == ["0", "1"]
    if master_addr is not None:
        assert {r["MASTER_ADDR"] for r in ranks} == {master_addr}, ranks
    return ranks
