"""The node runner: start one node's ranks, pump their output, wait, collect, clean up.

The same code runs on the driver (local mode) and inside a Spark barrier task (distributed
mode). It imports neither pyspark nor torch.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from spark_torch import envelopes
from spark_torch.errors import RankFailure
from spark_torch.node.processes import RankProcess, interrupts_deferred, kill_group, signal_name, spawn_rank
from spark_torch.node.rank_env import RankIdentity, rank_env
from spark_torch.node.store_host import AGENT_STORE_ENV, StoreHost, host_store
from spark_torch.reporting.api import CHECKPOINT_ENV, REPORT_FDS_ENV, START_STEP_ENV, STORAGE_ENV
from spark_torch.reporting.pipes import NodeReports
from spark_torch.spec import RunSpec

__all__ = [
    "NodeSpec",
    "NodeOutcome",
    "NodeWorkdir",
    "run_node",
    "scratch_root",
    "node_marker",
    "resume_env",
    "RANK_MAIN_MODULE",
]

RANK_MAIN_MODULE = "spark_torch.rank.function_main"
SCRIPT_MAIN_MODULE = "spark_torch.rank.script_main"
REAPER_MODULE = "spark_torch.node.reaper_main"
GRACE_SECONDS = 5.0
#: after Ctrl-C (or another exception in the node runner), the ranks get this long to exit
INTERRUPT_GRACE_SECONDS = 2.0


@dataclass(frozen=True)
class NodeSpec:
    """One node of a run: the run's :class:`~spark_torch.spec.RunSpec` plus where this node sits."""

    run: RunSpec
    node_rank: int
    master_addr: str
    master_port: int
    host: str = field(default_factory=socket.gethostname)
    #: CUDA_VISIBLE_DEVICES of every rank of this node (None: leave as inherited)
    visible_devices: str | None = None
    #: variables for this node's ranks on top of the run's (e.g. where its data file is)
    node_env: Mapping[str, str] = field(default_factory=dict)
    #: where the ranks start (None: this process's cwd)
    cwd: str | None = None
    python: str = sys.executable
    #: the rendezvous store is hosted before the ranks start (:mod:`spark_torch.node.store_host`):
    #: rank 0 connects to it instead of hosting it
    agent_store: bool = False

    @property
    def procs_per_node(self) -> int:
        """Ranks on this node."""
        return self.run.plan.procs_per_node

    def global_rank(self, local_rank: int) -> int:
        """Global rank of a local rank on this node."""
        return self.node_rank * self.procs_per_node + local_rank


@dataclass
class NodeOutcome:
    """What happened on one node: failures by rank, and rank 0's result file if it ran here."""

    failures: list[RankFailure] = field(default_factory=list)
    #: rank 0's pickled return value, inside the node's workdir (gone when the workdir is)
    result_file: str | None = None
    stopped: bool = False  # stopped from outside (timeout / cancellation)
    running_at_stop: list[RankFailure] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when every rank of this node exited cleanly."""
        return not self.failures and not self.stopped


def _argv(spec: NodeSpec, payload_path: str | None, result_dir: str) -> list[str]:
    if spec.run.script is not None:
        return [spec.python, "-m", SCRIPT_MAIN_MODULE, spec.run.script, *spec.run.script_argv]
    assert payload_path is not None
    return [spec.python, "-m", RANK_MAIN_MODULE, payload_path, result_dir]


def _rank_env(spec: NodeSpec, local_rank: int, workdir: str) -> dict[str, str]:
    run = spec.run
    identity = RankIdentity(
        rank=spec.global_rank(local_rank),
        local_rank=local_rank,
        world_size=run.world_size,
        local_world_size=spec.procs_per_node,
        node_rank=spec.node_rank,
        num_nodes=run.plan.num_nodes,
    )
    env = rank_env(
        os.environ,
        identity,
        master_addr=spec.master_addr,
        master_port=spec.master_port,
        run_id=run.run_id,
        restart_count=run.restart_count,
        max_restarts=run.max_restarts,
        threads=run.plan.threads_per_rank,
        cuda_visible_devices=spec.visible_devices,
        extra={**run.extra_env, **spec.node_env},
    )
    # like torchrun: torch's @record writes the rank's error there; it becomes the traceback
    if "TORCHELASTIC_ERROR_FILE" not in run.extra_env:
        env["TORCHELASTIC_ERROR_FILE"] = envelopes.elastic_error_path(workdir, identity.rank)
    if run.storage_base is not None:
        env[STORAGE_ENV] = f"{run.storage_base}\n{run.run_id}\n{run.storage_token}"
        env[START_STEP_ENV] = str(run.resume_step)
    if spec.agent_store:
        env[AGENT_STORE_ENV] = "True"
    return _with_package_on_path(env)


def start_store_host(run: RunSpec, port: int, cwd: str | None, python: str = sys.executable) -> StoreHost | None:
    """Node 0: host the run's rendezvous store on ``port`` before any rank starts (None: not
    hosted; rank 0 hosts it as usual). Its environment has the ranks' import path, so it is
    forked from the same warm-start template."""
    if run.world_size < 2:  # nobody to race with
        return None
    env = _with_package_on_path({**os.environ, **run.extra_env})
    return host_store(python, port, run.world_size, env, cwd)


def _with_package_on_path(env: dict[str, str]) -> dict[str, str]:
    """Children run ``python -m spark_torch.…`` from wherever this process found spark_torch."""
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
    return env


def _failure(spec: NodeSpec, proc: RankProcess, result_dir: str, failed_at: float) -> RankFailure:
    code = proc.popen.returncode
    report = (
        envelopes.read_error(result_dir, proc.rank)
        or envelopes.read_elastic_error(envelopes.elastic_error_path(result_dir, proc.rank))
        or {}
    )
    return RankFailure(
        rank=proc.rank,
        host=spec.host,
        exit_code=code if code is not None and code >= 0 else None,
        signal_name=signal_name(code),
        exc_type=report.get("exc_type"),
        exc_message=report.get("exc_message"),
        traceback=report.get("traceback"),
        last_lines=tuple(proc.tail),
        started_at=proc.started_at,
        failed_at=float(report["time"]) if isinstance(report.get("time"), (int, float)) else failed_at,
    )


def node_marker(run_id: str, node_rank: int) -> dict[str, str]:
    """Environment items every rank of this node, and everything they start, inherits: how the
    node's processes are found even after they left the rank's process group."""
    return {"SPARK_TORCH_RUN_ID": run_id, "NODE_RANK": str(node_rank)}


def _start_reaper(python: str, workdir: str, marker: Mapping[str, str]) -> subprocess.Popen[bytes] | None:
    """The watchdog that cleans up if this process dies before its own cleanup runs."""
    env = _with_package_on_path(dict(os.environ))
    try:
        return subprocess.Popen(
            [python, "-m", REAPER_MODULE, workdir, *(f"{k}={v}" for k, v in marker.items())],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            close_fds=True,
            env=env,
        )
    except OSError:
        return None


def _tell_reaper(reaper: subprocess.Popen[bytes] | None, line: str) -> None:
    if reaper is None or reaper.stdin is None:
        return
    try:
        reaper.stdin.write(line.encode("ascii") + b"\n")
        reaper.stdin.flush()
    except (BrokenPipeError, ValueError):
        pass


def scratch_root(environ: Mapping[str, str] | None = None) -> str | None:
    """Where a node keeps its files: the first usable of Spark's local dirs (``SPARK_LOCAL_DIRS``,
    which Spark gives its Python workers; ``LOCAL_DIRS`` on YARN), else None (the temp dir).

    Spark's local dirs are the disks the cluster meant for scratch data, and Spark removes
    them with the executor; ``/tmp`` is often small or a RAM disk.
    """
    env = os.environ if environ is None else environ
    for var in ("SPARK_LOCAL_DIRS", "LOCAL_DIRS"):
        for directory in (env.get(var) or "").split(","):
            directory = directory.strip()
            if directory and os.path.isdir(directory) and os.access(directory, os.W_OK | os.X_OK):
                return directory
    return None


def resume_env(run: RunSpec, workdir: str) -> dict[str, str]:
    """``SPARK_TORCH_CHECKPOINT`` for the ranks: the checkpoint this attempt resumes from, as a
    local directory (storage that is not a local path is downloaded into the node's scratch)."""
    if run.resume_url is None or run.storage_base is None:
        return {}
    from spark_torch.reporting.storage import CheckpointInfo, RunStorage

    local = RunStorage(run.storage_base, run.run_id).download(
        CheckpointInfo(step=run.resume_step, url=run.resume_url), os.path.join(workdir, "checkpoint")
    )
    return {CHECKPOINT_ENV: local}


class NodeWorkdir:
    """A node's scratch dir (payload, results, data; mode 0700), guarded by a reaper; removed on exit."""

    def __init__(self, run_id: str, node_rank: int, python: str = sys.executable, *, role: str = "node") -> None:
        self.path = tempfile.mkdtemp(prefix=f"spark-torch-{run_id}-{role}{node_rank}-", dir=scratch_root())
        # the driver's result dir guards no ranks; a node's reaper also finds the node's orphans
        self._reaper = _start_reaper(python, self.path, node_marker(run_id, node_rank) if role == "node" else {})

    def track(self, pgid: int, created: float) -> None:
        """Tell the reaper about a process group (and its leader's creation time) to stop if this process dies."""
        _tell_reaper(self._reaper, f"{pgid} {created!r}")

    def __enter__(self) -> NodeWorkdir:
        return self

    def __exit__(self, *exc_info: object) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        if self._reaper is not None:
            _tell_reaper(self._reaper, "done")
            if self._reaper.stdin is not None:
                self._reaper.stdin.close()
            self._reaper.wait()


def run_node(
    spec: NodeSpec,
    on_lines: Callable[[int, str, str], None],
    *,
    stop: threading.Event | None = None,
    workdir: NodeWorkdir | None = None,
    reports: NodeReports | None = None,
    on_failure: Callable[[RankFailure, str | None], None] | None = None,
) -> tuple[NodeOutcome, dict[int, str | None]]:
    """Run this node's ranks to completion (or first failure, or ``stop``) and clean up.

    Uses (and leaves to the caller) ``workdir`` when given, else makes and removes its own.
    Returns the outcome and, per failed rank, its pickled exception (base64) when it wrote one.
    """
    if workdir is None:
        with NodeWorkdir(spec.run.run_id, spec.node_rank, spec.python) as own:
            return run_node(spec, on_lines, stop=stop, workdir=own, reports=reports, on_failure=on_failure)
    guard = workdir
    workdir_path = guard.path
    outcome = NodeOutcome()
    pickled: dict[int, str | None] = {}
    procs: list[RankProcess] = []
    marker = node_marker(spec.run.run_id, spec.node_rank)
    cleaned = False
    exited: list[tuple[RankProcess, float]] = []
    changed = threading.Condition()
    try:
        payload_path = None
        if spec.run.payload is not None:
            payload_path = os.path.join(workdir_path, "payload.pkl")
            envelopes.write_atomic(payload_path, spec.run.payload)
        argv = _argv(spec, payload_path, workdir_path)

        rank_event = getattr(on_lines, "rank_event", None)

        def watch(proc: RankProcess) -> None:
            proc.popen.wait()
            if rank_event is not None:
                rank_event(proc.rank, "finished" if proc.popen.returncode == 0 else "failed")
            with changed:
                exited.append((proc, time.time()))
                changed.notify_all()

        for local_rank in range(spec.procs_per_node):
            env = _rank_env(spec, local_rank, workdir_path)
            fds: tuple[int, ...] = ()
            if reports is not None:
                fds = reports.open(spec.global_rank(local_rank))
                env[REPORT_FDS_ENV] = ",".join(map(str, fds))
            with interrupts_deferred():  # a Ctrl-C now must not orphan a half-registered rank
                try:
                    proc = spawn_rank(
                        argv,
                        env,
                        rank=spec.global_rank(local_rank),
                        local_rank=local_rank,
                        cwd=spec.cwd,
                        on_lines=on_lines,
                        pass_fds=fds,
                    )
                finally:
                    if reports is not None:
                        reports.started(spec.global_rank(local_rank))
                procs.append(proc)
                guard.track(proc.pid, proc.created)
                if rank_event is not None:
                    rank_event(proc.rank, "started")
                threading.Thread(
                    target=watch, args=(proc,), daemon=True, name=f"spark-torch-wait-{proc.rank}"
                ).start()

        seen = 0
        with changed:
            while seen < len(procs):
                if seen == len(exited):
                    # exits that already happened count first: a run that finished right at
                    # its deadline is a success, not a timeout
                    if stop is not None and stop.is_set():
                        outcome.stopped = True
                        break
                    # wake up for exits right away; re-check ``stop`` a few times a second
                    changed.wait(timeout=0.2 if stop is not None else None)
                    continue
                proc, when = exited[seen]
                seen += 1
                if proc.popen.returncode != 0:
                    if on_failure is not None:  # at once: the rest of the gang is failing now too
                        blob = (envelopes.read_error(workdir_path, proc.rank) or {}).get("pickled")
                        on_failure(_failure(spec, proc, workdir_path, when), blob)
                    for pump in proc.pumps:
                        pump.join(timeout=2.0)
                    outcome.failures.append(_failure(spec, proc, workdir_path, when))
                    pickled[proc.rank] = (envelopes.read_error(workdir_path, proc.rank) or {}).get("pickled")
                    break
        still_running = [p for p in procs if p.popen.poll() is None]
        if outcome.stopped:
            outcome.running_at_stop = [
                RankFailure(
                    rank=p.rank,
                    host=spec.host,
                    exc_type="still running",
                    exc_message="stopped",
                    last_lines=tuple(p.tail),
                    started_at=p.started_at,
                )
                for p in still_running
            ]
        kill_group(procs, grace=GRACE_SECONDS, marker=marker)
        cleaned = True
        for proc in procs:
            for pump in proc.pumps:
                pump.join(timeout=2.0)
        if not outcome.failures and not outcome.stopped and spec.run.payload is not None:
            if spec.node_rank == 0:
                path = envelopes.result_path(workdir_path, 0)
                if os.path.isfile(path):
                    outcome.result_file = path
                else:
                    outcome.failures.append(
                        RankFailure(rank=0, host=spec.host, exit_code=0, exc_type="RuntimeError",
                                    exc_message="rank 0 exited with code 0 but wrote no result "
                                    "(did the function call os._exit(0)?)",
                                    last_lines=tuple(procs[0].tail), failed_at=time.time())
                    )
        return outcome, pickled
    finally:
        if procs and not cleaned:  # an exception (Ctrl-C): a short grace, then SIGKILL
            kill_group(procs, grace=INTERRUPT_GRACE_SECONDS, marker=marker)
