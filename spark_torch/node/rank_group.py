"""The rank group: start one node's ranks, pump their output, wait, collect, clean up.

Called by the node runner (:mod:`spark_torch.node.lifecycle`) on the driver (local mode) and inside a
Spark barrier task (distributed mode). It imports neither pyspark nor torch; ranks are started
by module name (``python -m spark_torch.rank.function_main`` / ``script_main``).
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

from spark_torch.base import envnames
from spark_torch.base.grace import INTERRUPT_GRACE_SECONDS, RANK_GRACE_SECONDS
from spark_torch.base.states import GroupState, RankState, StopReason, StopSignal
from spark_torch.errors import RankFailure
from spark_torch.node.group_result import GroupResult, RankStatus
from spark_torch.node.processes import (
    RankProcess,
    interrupts_deferred,
    kill_group,
    signal_name,
    spawn_rank,
    with_package_on_path,
)
from spark_torch.node.progress import ProgressWatch, sample_interval
from spark_torch.node.rank_env import RankIdentity, rank_env
from spark_torch.node.torch_dumps import watchdog_dumps
from spark_torch.node.workdir import NodeWorkdir
from spark_torch.reporting.pipes import NodeReports
from spark_torch.shared import rank_files
from spark_torch.shared.lines import RankOutput
from spark_torch.shared.rank_files import RankError
from spark_torch.shared.spec import FILE_ARGUMENT, RunSpec
from spark_torch.shared.workdir_files import StorageFile, WorkdirFiles, open_private

__all__ = [
    "NodeSpec",
    "RankGroup",
    "run_ranks",
    "RANK_MAIN_MODULE",
    "SCRIPT_MAIN_MODULE",
]

RANK_MAIN_MODULE = "spark_torch.rank.function_main"
SCRIPT_MAIN_MODULE = "spark_torch.rank.script_main"


@dataclass(frozen=True)
class NodeSpec:
    """One node of a run: the run's :class:`~spark_torch.shared.spec.RunSpec` plus where this node sits."""

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


def _argv(spec: NodeSpec, files: WorkdirFiles) -> list[str]:
    if spec.run.script is not None:
        argv = [files.file(a[len(FILE_ARGUMENT) :]) if a.startswith(FILE_ARGUMENT) else a for a in spec.run.script_argv]
        return [spec.python, "-m", SCRIPT_MAIN_MODULE, spec.run.script, *argv]
    return [spec.python, "-m", RANK_MAIN_MODULE, files.payload(), files.path]


#: collectives the Flight Recorder keeps per process group (unless the user set a size)
FLIGHT_RECORDER_ENTRIES = 2000


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
    if envnames.TORCHELASTIC_ERROR_FILE not in run.extra_env:
        env[envnames.TORCHELASTIC_ERROR_FILE] = WorkdirFiles(workdir).elastic_error(identity.rank)
    if run.storage is not None:
        env[envnames.STORAGE] = WorkdirFiles(workdir).storage()
        env[envnames.START_STEP] = str(run.resume_step)
    if spec.agent_store:
        env[envnames.TORCHELASTIC_USE_AGENT_STORE] = "True"
    elif identity.rank == 0:  # not hosted before the ranks: rank 0 hosts it on MASTER_ADDR (spark_torch.rank.store)
        env[envnames.HOST_STORE] = "1"
    return with_package_on_path(env)


def _failure(spec: NodeSpec, proc: RankProcess, error: RankError | None, failed_at: float) -> RankFailure:
    code = proc.popen.returncode
    return RankFailure(
        rank=proc.rank,
        host=spec.host,
        exit_code=code if code is not None and code >= 0 else None,
        signal_name=signal_name(code),
        exc_type=error.exc_type if error is not None else None,
        exc_message=error.exc_message if error is not None else None,
        traceback=error.traceback if error is not None else None,
        last_lines=tuple(proc.tail),
        started_at=proc.started_at,
        failed_at=error.time if error is not None and error.time is not None else failed_at,
        dumps=_torch_dumps(spec, proc),
    )


def _torch_dumps(spec: NodeSpec, proc: RankProcess) -> tuple[str, ...]:
    """What torch's NCCL watchdog dumped of this rank (its environment as :func:`_rank_env` builds it)."""
    return watchdog_dumps({**os.environ, **spec.run.extra_env, **spec.node_env}, proc.rank, proc.started_at)


class RankGroup:
    """This node's ranks as one object, the shape of torch elastic's ``PContext``:

    :meth:`start` writes what the ranks read (payload, files, the storage's description) and
    starts them (warm or cold), :meth:`wait` blocks until every rank exited, one failed, or
    ``stop`` is set, :meth:`stop` stops what still runs (SIGTERM, a grace, SIGKILL; the whole
    process trees) and joins their output, :meth:`result` is what the node reports. As a
    context manager, leaving the block (an exception, Ctrl-C) stops them with a short grace.
    With ``on_progress`` and a ``stall_timeout``, a :class:`~spark_torch.node.progress.ProgressWatch`
    (handed to ``watching``) samples the ranks for stall detection; their Flight Recorder
    traces, when asked for, go to ``on_trace``.
    """

    def __init__(
        self,
        spec: NodeSpec,
        on_lines: RankOutput,
        workdir: NodeWorkdir,
        *,
        reports: NodeReports | None = None,
        on_failure: Callable[[RankFailure, str | None], None] | None = None,
        on_progress: Callable[[list[dict[str, object]]], None] | None = None,
        on_trace: Callable[[int, bytes], None] | None = None,
        watching: Callable[[ProgressWatch], None] | None = None,
    ) -> None:
        self.spec = spec
        self._workdir = workdir
        self._reports = reports
        self._on_failure = on_failure
        #: per failed rank, its pickled exception (base64) when it wrote one
        self._pickled: dict[int, str | None] = {}
        self._failure: RankFailure | None = None  # the first failure :meth:`wait` saw
        self._stopped_from_outside = False  # :meth:`wait` returned because ``stop`` was set
        self._running_at_stop: set[int] = set()
        self._stop_reason: StopReason | None = None  # the ranks that stop found running (stopped, whatever their exit)
        #: each rank's state once its process exited
        self._states: dict[int, RankState] = {}
        self._procs: list[RankProcess] = []
        self._exited: list[tuple[RankProcess, float]] = []
        self._changed = threading.Condition()
        self._stopping = threading.Event()  # set once the node stops its ranks (their exits are "stopped")
        self._stopped = False
        self._progress = self._progress_watch(on_progress, on_trace)
        self._on_lines = self._progress.observing(on_lines) if self._progress is not None else on_lines
        if self._progress is not None and watching is not None:
            watching(self._progress)

    def _progress_watch(
        self,
        on_progress: Callable[[list[dict[str, object]]], None] | None,
        on_trace: Callable[[int, bytes], None] | None,
    ) -> ProgressWatch | None:
        settings = self.spec.run.settings
        if on_progress is None or settings.stall_timeout <= 0:
            return None
        ranks = [self.spec.global_rank(local) for local in range(self.spec.procs_per_node)]
        return ProgressWatch(
            {rank: WorkdirFiles(self._workdir.path).stack(rank) for rank in ranks},
            sample_interval(settings.stall_timeout),
            on_progress,
            send_trace=on_trace,
            source_lines=settings.stall_source_lines,
        )

    def __enter__(self) -> RankGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.close()
        if self._procs and not self._stopped:  # an exception (Ctrl-C): a short grace, then SIGKILL
            self.stop(INTERRUPT_GRACE_SECONDS)

    # start
    def _write_inputs(self) -> list[str]:
        spec, files = self.spec, WorkdirFiles(self._workdir.path)
        if spec.run.storage is not None:  # how ranks open the storage: a 0600 file, not their environment
            rank_files.write_atomic(files.storage(), StorageFile.of(spec.run.storage, spec.run.run_id).to_json())
        if spec.run.files:
            os.makedirs(files.files_dir(), mode=0o700, exist_ok=True)
            for name, content in spec.run.files.items():
                rank_files.write_atomic(files.file(name), content)
        if spec.run.payload is not None:
            rank_files.write_atomic(files.payload(), spec.run.payload)
        return _argv(spec, files)

    def _env(self, local_rank: int) -> dict[str, str]:
        spec, settings = self.spec, self.spec.run.settings
        env = _rank_env(spec, local_rank, self._workdir.path)
        env.update(self._workdir.marker)  # this attempt's: a stop finds its processes, no other
        elastic = env.get(envnames.TORCHELASTIC_ERROR_FILE, "")
        if os.path.dirname(elastic) == self._workdir.path:  # torch's @record opens it with the umask's mode:
            open_private(elastic).close()  # made 0600 first (empty: no error, as before)
        if self._progress is not None:  # the rank's stack sampler (spark_torch.rank.sampler)
            env[envnames.STACK_FILE] = WorkdirFiles(self._workdir.path).stack(spec.global_rank(local_rank))
            env[envnames.SAMPLE_SECONDS] = f"{sample_interval(settings.stall_timeout):g}"
            env[envnames.STACK_ALL_THREADS] = "1" if settings.stall_all_threads else "0"
            env[envnames.STACK_SOURCE_LINES] = "1" if settings.stall_source_lines else "0"
            # torch's Flight Recorder: what each rank's collectives were, for a stall (its older
            # name, TORCH_NCCL_TRACE_BUFFER_SIZE, makes torch warn: set only if the user did)
            if envnames.NCCL_TRACE_BUFFER_SIZE not in env:
                env.setdefault(envnames.FR_BUFFER_SIZE, str(FLIGHT_RECORDER_ENTRIES))
        return env

    def _watch(self, proc: RankProcess) -> None:
        proc.popen.wait()
        if proc.popen.returncode == 0:
            state = RankState.FINISHED
        else:  # a rank this node was already stopping did not fail by itself
            state = RankState.STOPPED if self._stopping.is_set() else RankState.FAILED
        self._on_lines.rank_event(proc.rank, state)
        with self._changed:
            self._states[proc.rank] = state
            self._exited.append((proc, time.time()))
            self._changed.notify_all()

    def start(self) -> None:
        """Start every rank of this node (each tracked by the workdir's reaper at once)."""
        spec, reports = self.spec, self._reports
        argv = self._write_inputs()
        for local_rank in range(spec.procs_per_node):
            rank = spec.global_rank(local_rank)
            env = self._env(local_rank)
            fds: tuple[int, ...] = ()
            if reports is not None:
                fds = reports.open(rank)
                env[envnames.REPORT_FDS] = ",".join(map(str, fds))
            with interrupts_deferred():  # a Ctrl-C now must not orphan a half-registered rank
                try:
                    proc = spawn_rank(
                        argv,
                        env,
                        rank=rank,
                        local_rank=local_rank,
                        cwd=spec.cwd,
                        on_lines=self._on_lines,
                        pass_fds=fds,
                        warm=spec.run.settings.warm_start,
                        warm_idle=spec.run.settings.warm_start_idle,
                    )
                finally:
                    if reports is not None:
                        reports.started(rank)
                self._procs.append(proc)
                self._workdir.track(proc.pid, proc.created)
                if self._progress is not None:
                    self._progress.started(rank, proc.pid)
                self._on_lines.rank_event(proc.rank, RankState.STARTED)
                threading.Thread(
                    target=self._watch, args=(proc,), daemon=True, name=f"spark-torch-wait-{proc.rank}"
                ).start()
        if self._progress is not None:
            self._progress.start()

    # wait
    def wait(self, stop: StopSignal | None = None) -> None:
        """Until every rank exited, the first failed (reported at once through ``on_failure``),
        or ``stop`` is set (the ranks still running are then the ones stopped from outside, for
        the stop's reason)."""
        spec, path = self.spec, self._workdir.path
        seen = 0
        with self._changed:
            while seen < len(self._procs):
                if seen == len(self._exited):
                    # exits that already happened count first: a run that finished right at
                    # its deadline is a success, not a timeout
                    if stop is not None and stop.is_set():
                        self._stopped_from_outside, self._stop_reason = True, stop.reason
                        break
                    # wake up for exits right away; re-check ``stop`` a few times a second
                    self._changed.wait(timeout=0.2 if stop is not None else None)
                    continue
                proc, when = self._exited[seen]
                seen += 1
                if proc.popen.returncode != 0:
                    error = rank_files.read_rank_error(path, proc.rank)  # read once, typed
                    blob = error.pickled if error is not None else None
                    failure = _failure(spec, proc, error, when)
                    if self._on_failure is not None:  # at once: the rest of the gang is failing now too
                        self._on_failure(failure, blob)
                    for pump in proc.pumps:
                        pump.join(timeout=2.0)
                    self._failure = replace(failure, last_lines=tuple(proc.tail))  # with the lines pumped since
                    self._pickled[proc.rank] = blob
                    break
            if self._stopped_from_outside:  # what still runs now is what the stop ends
                self._running_at_stop = {proc.rank for proc in self._procs if proc.popen.poll() is None}

    # stop
    def stop(self, grace: float = RANK_GRACE_SECONDS) -> None:
        """Stop every rank still running (their whole trees: SIGTERM, ``grace``, SIGKILL) and
        join their output pumps. Idempotent."""
        if self._stopped:
            return
        self._stopping.set()
        kill_group(self._procs, grace=grace, marker=self._workdir.marker)
        self._stopped = True
        for proc in self._procs:
            for pump in proc.pumps:
                pump.join(timeout=2.0)

    def result(self) -> GroupResult:
        """What this node reports, after :meth:`stop`: the group's state, each rank's status, and
        rank 0's result file when it ran here and every rank succeeded (a rank 0 that wrote
        none failed)."""
        spec, failure = self.spec, self._failure
        if failure is None and not self._stopped_from_outside and spec.run.payload is not None and spec.node_rank == 0:
            path = WorkdirFiles(self._workdir.path).result(0)
            if os.path.isfile(path):
                return GroupResult(GroupState.SUCCEEDED, self._statuses(None), result_file=path)
            failure = RankFailure(
                rank=0,
                host=spec.host,
                exit_code=0,  # it raised nothing: no exception type to name
                exc_message="it wrote no result (did the function call os._exit(0)?)",
                last_lines=tuple(self._procs[0].tail),
                failed_at=time.time(),
            )
        if failure is not None:
            state = GroupState.FAILED
        else:
            state = GroupState.STOPPED if self._stopped_from_outside else GroupState.SUCCEEDED
        return GroupResult(state, self._statuses(failure), pickled=dict(self._pickled), stop_reason=self._stop_reason)

    def _statuses(self, failure: RankFailure | None) -> tuple[RankStatus, ...]:
        with self._changed:
            states = {**self._states, **dict.fromkeys(self._running_at_stop, RankState.STOPPED)}

        def status(proc: RankProcess) -> RankStatus:
            failed = failure is not None and failure.rank == proc.rank
            state = RankState.FAILED if failed else states.get(proc.rank, RankState.STOPPED)
            # a stopped rank may have hung after torch's watchdog dumped it (a NCCL timeout that did not end it)
            dumps = _torch_dumps(self.spec, proc) if state is RankState.STOPPED else ()
            return RankStatus(proc.rank, state, tuple(proc.tail), proc.started_at, failure if failed else None, dumps)

        return tuple(status(proc) for proc in self._procs)


def run_ranks(
    spec: NodeSpec,
    on_lines: RankOutput,
    workdir: NodeWorkdir,
    *,
    stop: StopSignal | None = None,
    reports: NodeReports | None = None,
    on_failure: Callable[[RankFailure, str | None], None] | None = None,
    on_progress: Callable[[list[dict[str, object]]], None] | None = None,
    on_trace: Callable[[int, bytes], None] | None = None,
    watching: Callable[[ProgressWatch], None] | None = None,
) -> GroupResult:
    """Run this node's ranks (a :class:`RankGroup`) in ``workdir`` to completion, first failure
    or ``stop``, and clean up."""
    with RankGroup(
        spec,
        on_lines,
        workdir,
        reports=reports,
        on_failure=on_failure,
        on_progress=on_progress,
        on_trace=on_trace,
        watching=watching,
    ) as group:
        group.start()
        group.wait(stop)
        group.stop()
        return group.result()
