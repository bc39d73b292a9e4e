"""The node runner: one node of a run, the same sequence in both modes.

:func:`run_node` stages the node's DataFrame rows, reserves the master port and hosts the
rendezvous store (node 0), rendezvouses with the other nodes, checks what the node can check
(Python versions, shard sizes, the script, GPUs), builds the node's environment (data, resume
checkpoint, report pipes) and runs the ranks (:func:`~spark_torch.node.rank_group.run_ranks`),
cleaning up whatever it started. Where it runs is a :class:`NodeIO`: local mode passes one
that lives on the driver (:mod:`spark_torch.driver.run.local`), a barrier task one that talks to the
driver's channel and Spark (:mod:`spark_torch.node.task`).
"""

from __future__ import annotations

import os
import platform
import socket
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

from spark_torch.base import envnames
from spark_torch.base.states import Problem, ProblemKind, ShardUse, StopReason, StopSignal
from spark_torch.errors import ClusterConfigurationError, RankFailure
from spark_torch.node.gpus import node_gpus, through_visible
from spark_torch.node.group_result import GroupResult
from spark_torch.node.processes import reserve_port
from spark_torch.node.progress import ProgressWatch
from spark_torch.node.rank_group import NodeSpec, run_ranks
from spark_torch.node.shard_reuse import NodeShard, Placement, node_shard
from spark_torch.node.staging import check_shards, data_env
from spark_torch.node.store_host import StoreHost, hosts_store, start_store_host
from spark_torch.node.workdir import NodeWorkdir
from spark_torch.reporting.pipes import NodeReports
from spark_torch.shared.column_files import NullValuesError
from spark_torch.shared.lines import RankOutput
from spark_torch.shared.node_outcome import NodeOutcome
from spark_torch.shared.spec import RunSpec
from spark_torch.shared.workdir_files import WorkdirFiles, make_private
from spark_torch.version import package_identity

if TYPE_CHECKING:
    from spark_torch.ft.node_relay import NodeRelay

__all__ = [
    "NodeIO",
    "NodeProblem",
    "NodeResult",
    "run_node",
    "resume_env",
    "python_mismatch",
    "package_mismatch",
    "host_of",
]


class NodeProblem(Exception):
    """This node cannot run its ranks (found before any started): its :class:`Problem` (the
    kind of error the user gets and the message). Raised inside the node runner only: it leaves
    as the node's outcome (:meth:`outcome`)."""

    def __init__(self, message: str, kind: ProblemKind = ProblemKind.LAUNCH) -> None:
        super().__init__(message)
        self.problem = Problem(kind, message)

    def outcome(self) -> NodeOutcome:
        """The node's end: no rank started, because of this problem."""
        return NodeOutcome(problem=self.problem)


class NodeIO(Protocol):
    """Where a node runs: what the node runner needs from the driver, Spark and the other nodes."""

    node_rank: int
    #: this node's host, as the other nodes and messages name it
    host: str
    #: the host the ranks' master (node 0) listens on
    master_host: str
    #: requested from outside to stop the ranks, with the reason (timeout, stall, cancellation,
    #: another node failed, growing): the node's result reports the reason it acted on
    stop: StopSignal

    def rendezvous(self, hello: dict[str, Any]) -> list[dict[str, Any]] | None:
        """Every node's hello in node order; None if the run was stopped meanwhile. Raises
        :class:`NodeProblem` when the nodes cannot meet."""

    def output(self) -> RankOutput:
        """Where the ranks' output goes (asked once, after the rendezvous)."""

    def task_gpus(self) -> list[str]:
        """The GPU addresses Spark assigned to this node's task."""

    def report_pipes(self, ranks: range) -> NodeReports | None:
        """The report() pipes of this node's ``ranks``, wired to the driver (None: report() is not served)."""

    def rank_failed(self, failure: RankFailure, pickled: str | None) -> None:
        """A rank failed: tell the driver at once (the rest of the gang is failing now too)."""

    def progress(self, stacks: list[dict[str, Any]]) -> None:
        """A snapshot of the ranks' progress and stacks (:class:`~spark_torch.shared.stacks.RankStack` dicts)."""

    def trace(self, rank: int, data: bytes) -> None:
        """A rank's Flight Recorder trace (a pickle: the driver stores it, never loads it)."""

    def watching(self, watch: ProgressWatch) -> None:
        """The node's progress watch (the driver asks it for traces through this NodeIO)."""


@dataclass(frozen=True)
class NodeResult:
    """What a node produced: its rank group's result (None when the rendezvous was stopped,
    before any rank started: then the reason of that stop; or kept shards did not cover every
    node) and, for ``run_on_dataframe``, where its rows came from."""

    group: GroupResult | None
    stopped: StopReason | None = None
    shard: ShardUse | None = None

    def outcome(self) -> NodeOutcome:
        """How the node's part ended, as the driver gets it (the failed ranks included)."""
        if self.group is not None:
            return replace(self.group.outcome(), shard=self.shard)
        return NodeOutcome(stop=self.stopped, shard=self.shard)


def host_of(task_address: str) -> str:
    """The host of a barrier task's ``host:port`` address; an IPv6 host comes in brackets
    (``[::1]:41234``), which bind() and MASTER_ADDR do not take."""
    return task_address.rsplit(":", 1)[0].strip("[]")


def python_mismatch(driver: str, executors: list[str]) -> tuple[str | None, str | None]:
    """(error, warning) about Python versions: major.minor must match (pickles and bytecode
    differ between them), a patch difference only earns a warning."""
    versions = sorted({driver, *executors})
    if len({v.rsplit(".", 1)[0] for v in versions}) > 1:
        return (
            f"Python versions differ between the driver and executors ({', '.join(versions)}); "
            "set PYSPARK_PYTHON (or spark.pyspark.python) to the same interpreter everywhere",
            None,
        )
    if len(versions) > 1:
        return (
            None,
            f"[spark_torch] Python patch versions differ between the driver and executors ({', '.join(versions)})",
        )
    return None, None


def package_mismatch(driver: str, peers: list[dict[str, Any]]) -> str | None:
    """Why the nodes do not all run the driver's spark_torch (a message), or None."""
    if not driver:
        return None
    others = sorted(
        {
            f"{p.get('package')} on {p.get('host', 'node ' + str(p.get('node')))}"
            for p in peers
            if p.get("package") != driver
        }
    )
    if not others:
        return None
    return (
        f"the executors run another spark_torch than the driver ({driver}): {'; '.join(others)}. Leave the "
        "ship_package setting on (the default: the driver's package travels with the run), or install "
        f"spark-torch {driver.split('+')[0]} from the same source on every executor; with Python workers "
        "reused (spark.python.worker.reuse), restart the session after changing it"
    )


def resume_env(run: RunSpec, workdir: str) -> dict[str, str]:
    """``SPARK_TORCH_CHECKPOINT`` for the ranks: the checkpoint this attempt resumes from, as a
    local directory (storage that is not a local path is downloaded into the node's scratch)."""
    if run.resume_url is None or run.storage is None:
        return {}
    from spark_torch.reporting.ranking import CheckpointInfo
    from spark_torch.reporting.storage import RunStorage

    scratch = WorkdirFiles(workdir).checkpoint()
    local = RunStorage(run.storage.base, run.run_id, run.storage.options).download(
        CheckpointInfo(step=run.resume_step, url=run.resume_url), scratch
    )
    if local == scratch:  # fsspec's copy has the umask's modes
        make_private(scratch)
    return {envnames.CHECKPOINT: local}


def _visible_devices(run: RunSpec, io: NodeIO) -> str:
    """CUDA_VISIBLE_DEVICES of this node's ranks ("" without GPUs: they see none, as with
    TorchDistributor, not whatever was inherited)."""
    if not run.plan.use_gpu:
        return ""
    per_node = run.plan.procs_per_node
    if run.plan.local_gpus:  # the driver machine's GPUs (local mode, or a local master): this node's share
        return ",".join(node_gpus(run.plan.local_gpus, io.node_rank, per_node))
    try:
        return ",".join(through_visible(io.task_gpus()[:per_node], os.environ.get(envnames.CUDA_VISIBLE_DEVICES)))
    except ClusterConfigurationError as exc:
        raise NodeProblem(f"on executor host {io.host}: {exc}", kind=ProblemKind.CONFIGURATION) from None


def _usable_dir(path: str | None) -> str | None:
    return path if path and os.path.isdir(path) else None


def _stage_rows(run: RunSpec, io: NodeIO, workdir: NodeWorkdir, batches: Iterable[Any] | None) -> NodeShard | None:
    """The node's DataFrame rows (``run_on_dataframe``: :mod:`spark_torch.node.shard_reuse`); else
    drain the placeholder row. Nulls in a numeric column are the user's to fix: refused here,
    before any rank starts."""
    if run.data is not None:
        try:
            return node_shard(run, io.node_rank, workdir.path, batches)
        except NullValuesError as exc:
            raise NodeProblem(str(exc), kind=ProblemKind.CONFIGURATION) from None
    for _ in batches or ():  # one placeholder row per node
        pass
    return None


def _check_peers(run: RunSpec, io: NodeIO, peers: list[dict[str, Any]], output: RankOutput) -> None:
    """What every node must share: the Python minor version and the driver's package."""
    error, warning = python_mismatch(run.driver_python, [str(p.get("python")) for p in peers])
    if error:
        raise NodeProblem(error)
    mismatch = package_mismatch(run.driver_package, peers)
    if mismatch:
        raise NodeProblem(mismatch)
    if warning and io.node_rank == 0:
        output(-1, "stderr", warning)


def _node_env(run: RunSpec, io: NodeIO, workdir: NodeWorkdir, placement: Placement | None) -> dict[str, str]:
    """The variables every rank of this node gets on top of torchrun's: its DataFrame shard,
    the checkpoint it resumes from. Raises :class:`NodeProblem` for shards or a missing script."""
    node_env: dict[str, str] = {}
    if run.data is not None and placement is not None:
        groups = int(run.extra_env.get(envnames.NUM_REPLICA_GROUPS) or 1)  # every group stages all rows
        problem = check_shards(placement.rows_per_node, run.plan.procs_per_node, groups)
        if problem:
            raise NodeProblem(problem, kind=ProblemKind.CONFIGURATION)
        node_env.update(
            data_env(placement.path, run.data.columns, run.data.explicit, rows_per_node=placement.rows_per_node)
        )
    if run.script is not None and not os.path.isfile(run.script):
        raise NodeProblem(
            f"training script {run.script} does not exist on executor host {io.host}; "
            "in distributed mode the script must be at the same path on every executor "
            "(a shared filesystem, or ship it with spark.files / --files)"
        )
    node_env.update(resume_env(run, workdir.path))
    return node_env


def _master_port(run: RunSpec, io: NodeIO, cwd: str | None) -> tuple[socket.socket | None, StoreHost | None]:
    """Node 0: a reserved port for the ranks' master and the rendezvous store already listening
    on it, on the node's own address (a store host that did not say "ready" in time may still take its
    port under load: rank 0 then hosts the store on a freshly reserved one)."""
    if io.node_rank != 0:
        return None, None
    reservation = reserve_port(io.master_host)
    try:
        store = start_store_host(run, reservation.getsockname()[1], cwd, host=io.master_host)
    except BaseException:
        reservation.close()
        raise
    if store is None and hosts_store(run):
        reservation.close()
        reservation = reserve_port(io.master_host)
    return reservation, store


def run_node(
    run: RunSpec,
    io: NodeIO,
    workdir: NodeWorkdir,
    batches: Iterable[Any] | None = None,
) -> NodeResult:
    """Run this node of ``run`` to the end (see the module docstring).

    ``batches``: the node's share of the DataFrame (Arrow record batches) for
    ``run_on_dataframe``; otherwise whatever input rows shaped the stage (drained). Raises
    :class:`NodeProblem` for a problem found before any rank started.
    """
    shard = _stage_rows(run, io, workdir, batches)
    try:
        return _run_staged(run, io, workdir, shard)
    finally:
        if shard is not None:
            shard.close()  # the kept shard is free for a sweep once the ranks are done


def _run_staged(run: RunSpec, io: NodeIO, workdir: NodeWorkdir, shard: NodeShard | None) -> NodeResult:
    """:func:`run_node` once the node's rows are staged (or offered)."""
    cwd = _usable_dir(run.cwd)
    reservation, store = _master_port(run, io, cwd)
    reports = None
    relay: NodeRelay | None = None
    try:
        port = reservation.getsockname()[1] if reservation is not None else 0
        hello = {
            "port": port,
            "python": platform.python_version(),
            "package": package_identity(),
            "host": io.host,
            "rows": 0,
        }
        peers = io.rendezvous({**hello, **(shard.hello() if shard is not None else {})})
        if peers is None:
            return NodeResult(group=None, stopped=io.stop.reason)
        output = io.output()
        _check_peers(run, io, peers, output)
        placement = shard.place(peers) if shard is not None else None
        if shard is not None and placement is None:  # kept shards do not cover every node: restage
            return NodeResult(group=None, shard=shard.missed())
        node_env = _node_env(run, io, workdir, placement)
        relay = None
        if run.lighthouse_secret:  # replica groups in distributed mode: the ranks' way to torchft
            from spark_torch.ft import node_relay  # its handshake needs cryptography, which local mode does not

            relay = node_relay.start_for(run.extra_env, run.lighthouse_secret)
        node_env.update(relay.variables() if relay is not None else {})
        visible = _visible_devices(run, io)
        first = io.node_rank * run.plan.procs_per_node
        reports = io.report_pipes(range(first, first + run.plan.procs_per_node))
        spec = NodeSpec(
            run=run,
            node_rank=io.node_rank,
            master_addr=io.master_host,
            master_port=int(peers[0]["port"]),
            host=io.host,
            visible_devices=visible,
            node_env=node_env,
            cwd=cwd,
            agent_store=store is not None,
        )
        group = run_ranks(
            spec,
            output,
            workdir,
            stop=io.stop,
            reports=reports,
            on_failure=io.rank_failed,
            on_progress=io.progress,
            on_trace=io.trace,
            watching=io.watching,
        )
        return NodeResult(group=group, shard=placement.use if placement is not None else None)
    finally:
        if relay is not None:
            relay.close()
        if reports is not None:
            reports.close()
        if store is not None:
            store.close()
        if reservation is not None:
            reservation.close()
