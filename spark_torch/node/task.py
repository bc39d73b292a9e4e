"""Executor side of distributed mode: the body of one Spark barrier task (one node).

It rendezvouses with the other tasks through the driver's channel (each node says hello; node
0's hello carries the port it reserved), or, when the channel cannot be reached within the
rendezvous deadline, through one Spark ``allGather`` round (about a second). It runs the node's
ranks and returns rank 0's pickled result by file or as Arrow rows. A failure is raised as a
task exception carrying a report authenticated with the run's secret
(:mod:`spark_torch.failure_reports`): Spark then aborts the barrier stage at once (a barrier result
stage is never retried), kills the other tasks and hands the text to the driver. Imports no
driver-side module.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import sys
import threading
from collections.abc import Iterator
from typing import Any

from spark_torch import envelopes
from spark_torch.channel.ends import NodeChannel
from spark_torch.driver.dataframe import check_shards, data_env, write_node_data
from spark_torch.errors import ClusterConfigurationError, RankFailure
from spark_torch.failure_reports import FailureReport, encode_report
from spark_torch.node.gpus import node_gpus, through_visible
from spark_torch.node.processes import reserve_port
from spark_torch.node.runner import NodeSpec, NodeWorkdir, resume_env, run_node, start_store_host
from spark_torch.reporting.pipes import NodeReports
from spark_torch.spec import RunSpec

__all__ = [
    "run_barrier_task",
    "RESULT_SCHEMA",
    "FINISHED_SEQ",
    "HANDED_OVER_SEQ",
    "CHANNEL_ERROR_SEQ",
    "STREAMED_SEQ",
    "STREAMED_RESULT_FILE",
    "RESULT_FILE",
    "python_mismatch",
    "host_of",
]

RESULT_SCHEMA = "node int, seq int, data binary"
#: row kinds besides the result's chunks (seq >= 0)
FINISHED_SEQ = -1
HANDED_OVER_SEQ = -2  # the result is in the driver's result_dir; data = its size in ASCII
CHANNEL_ERROR_SEQ = -3  # this node never reached the driver's channel; data = the last error (UTF-8)
STREAMED_SEQ = -4  # the result went over the channel into the driver's file; data = its size in ASCII
RESULT_FILE = "rank-0.result"
#: the file the driver writes what node 0 streams over the channel
STREAMED_RESULT_FILE = "rank-0.streamed-result"
#: how long the channel may go without taking a piece of the result before Spark carries it
STREAM_STALL_SECONDS = 60.0


class NodeFailed(RuntimeError):
    """Raised in the task so that Spark aborts the barrier stage; carries the encoded report."""


def _print_to_executor_log(rank: int, stream: str, block: str) -> None:
    """Without a driver channel, rank output goes to the executor's stderr log."""
    prefix = f"[rank {rank}] "
    sys.stderr.write(prefix + block.replace("\n", "\n" + prefix) + "\n")
    sys.stderr.flush()


def run_barrier_task(spec: RunSpec, batches: Iterator[Any]) -> Iterator[Any]:
    """``mapInArrow`` body: one node of the run."""
    from pyspark import BarrierTaskContext

    context = BarrierTaskContext.get()
    node_rank = context.partitionId()
    with NodeWorkdir(spec.run_id, node_rank) as workdir:
        outcome, channel_error, delivered = _run_node_task(spec, context, batches, workdir)
        if channel_error:
            yield _row(node_rank, CHANNEL_ERROR_SEQ, channel_error.encode("utf-8"))
        if outcome is None:
            return  # the driver asked us to stop (timeout, Ctrl-C, another node failed)
        # seq -1: "this node finished"; the driver checks that every node did
        yield _row(node_rank, FINISHED_SEQ, b"")
        if delivered is not None:  # rank 0's result is already with the driver (file or channel)
            yield _row(node_rank, delivered[0], str(delivered[1]).encode("ascii"))
        elif outcome.result_file is not None:
            yield from _result_rows(node_rank, outcome.result_file)


def _row(node_rank: int, seq: int, data: Any) -> Any:
    """One Arrow row of RESULT_SCHEMA; ``data`` may be bytes or a pyarrow Buffer (not copied)."""
    import pyarrow as pa

    buf = data if isinstance(data, pa.Buffer) else pa.py_buffer(data)
    offsets = pa.py_buffer(bytes(4) + len(buf).to_bytes(4, "little", signed=True))
    column = pa.Array.from_buffers(pa.binary(), 1, [None, offsets, buf])
    return pa.RecordBatch.from_arrays(
        [pa.array([node_rank], pa.int32()), pa.array([seq], pa.int32()), column], names=["node", "seq", "data"]
    )


def _hand_over(result_file: str, result_dir: str | None) -> int | None:
    """Move the result into the driver's ``result_dir`` if this host can; returns its size."""
    if not result_dir or not os.path.isdir(result_dir) or not os.access(result_dir, os.W_OK):
        return None
    target = os.path.join(result_dir, RESULT_FILE)
    try:
        size = os.path.getsize(result_file)
        try:
            os.replace(result_file, target)  # same filesystem: no copy
        except OSError:
            with open(result_file, "rb") as src:
                envelopes.write_atomic_from(target, src)
        return size
    except OSError:
        return None


def _deliver_result(spec: RunSpec, result_file: str, channel: NodeChannel | None) -> tuple[int, int] | None:
    """Rank 0's result straight to the driver: moved into the driver's directory when this host
    sees it (same host, shared filesystem), else streamed over the authenticated channel.
    Returns (row kind, size), or None: then it travels through Spark's result channel."""
    if spec.result_transfer == "auto":
        size = _hand_over(result_file, spec.result_dir)
        if size is not None:
            return HANDED_OVER_SEQ, size
    if spec.result_transfer in ("auto", "channel") and channel is not None:
        if channel.send_result(result_file, STREAM_STALL_SECONDS):
            return STREAMED_SEQ, os.path.getsize(result_file)
    return None


def _result_rows(node_rank: int, result_file: str) -> Iterator[Any]:
    """Rank 0's result through Spark's result channel, as 16 MiB Arrow rows."""
    with open(result_file, "rb") as fh:
        seq = 0
        while True:
            piece = fh.read(envelopes.CHUNK_SIZE)
            if not piece and seq > 0:
                break
            yield _row(node_rank, seq, piece)
            seq += 1
            if len(piece) < envelopes.CHUNK_SIZE:
                break


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
        return None, f"[spark_torch] Python patch versions differ between the driver and executors ({', '.join(versions)})"
    return None, None


class _Node:
    """The state of one barrier task while it runs (so the steps below stay small)."""

    def __init__(self, spec: RunSpec, context: Any, workdir: NodeWorkdir) -> None:
        self.spec = spec
        self.context = context
        self.workdir = workdir
        self.rank = context.partitionId()
        infos = context.getTaskInfos()
        self.master_host = host_of(infos[0].address)
        self.host = host_of(infos[self.rank].address) or socket.gethostname()
        self.first_rank = self.rank * spec.plan.procs_per_node
        self.stop = threading.Event()
        self.channel = (
            NodeChannel(spec.channel, self.rank, spec.plan.num_nodes, self.stop) if spec.channel is not None else None
        )

    def fail(self, message: str, kind: str = "LaunchError") -> NodeFailed:
        """A task exception for a problem of this node before its ranks ran."""
        failure = RankFailure(rank=self.first_rank, host=self.host, exc_type=kind, exc_message=message)
        report = FailureReport(failures=(failure,), kind=kind)
        return NodeFailed(f"{message}\n{self._encode(report)}")

    def _encode(self, report: FailureReport) -> str:
        secret = self.spec.channel.secret if self.spec.channel is not None else b""
        return encode_report(report, secret)

    def failed(self, failures: list[RankFailure], pickled: dict[int, str | None]) -> NodeFailed:
        """A task exception for ranks of this node that failed (the driver also got the report
        over the channel, when this node reaches it: see :meth:`report_failure`)."""
        root = failures[0]
        report = FailureReport(failures=tuple(failures), pickled={r: p for r, p in pickled.items() if p})
        # the cause in plain text is for people reading Spark's UI and logs; the driver only
        # trusts the authenticated report after it
        return NodeFailed(
            f"rank {root.rank} on {self.host} failed: {root.cause()[:2000]} "
            f"(report for the driver follows)\n{self._encode(report)}"
        )

    def rendezvous(self, hello: dict[str, Any]) -> list[dict[str, Any]] | None:
        """Every node's hello in node order, through the channel or Spark's allGather; None if stopped."""
        reason = "the run has no driver channel"
        if self.channel is not None:
            outcome = self.channel.rendezvous(hello)
            if outcome.stopped:
                return None
            if outcome.peers is not None:
                return outcome.peers
            reason = outcome.reason
        return self._all_gather({**hello, "node": self.rank}, reason)

    def _all_gather(self, hello: dict[str, Any], reason: str) -> list[dict[str, Any]]:
        timeout = self.spec.channel.rendezvous_timeout if self.spec.channel is not None else 60.0
        where = self.spec.channel.address if self.spec.channel is not None else "(none)"
        box: dict[str, Any] = {}
        done = threading.Event()

        def gather() -> None:
            try:
                box["messages"] = self.context.allGather(json.dumps(hello))
            except BaseException as exc:  # noqa: BLE001 - reported below
                box["error"] = exc
            finally:
                done.set()

        threading.Thread(target=gather, name="spark-torch-allgather", daemon=True).start()
        finished = done.wait(timeout)
        if not finished or "error" in box:
            detail = f"failed ({box['error']})" if finished else f"did not complete within {timeout:g}s"
            raise self.fail(
                f"the nodes could not rendezvous: the driver's channel at {where} was not usable ({reason}) "
                f"and the Spark barrier allGather fallback {detail}. Make {where} reachable from the "
                "executors (spark.driver.host / SPARK_TORCH_LOG_HOST, SPARK_TORCH_CHANNEL_PORTS for a "
                "firewall); see docs/troubleshooting.md"
            )
        return [json.loads(m) for m in box["messages"]]

    def sink(self) -> Any:
        """Where rank output goes: the driver's channel if this node reaches it, else the executor log."""
        if self.channel is not None and self.channel.detach_if_unreachable():
            return self.channel
        return _print_to_executor_log


def _run_node_task(
    spec: RunSpec, context: Any, batches: Iterator[Any], workdir: NodeWorkdir
) -> tuple[Any, str | None, tuple[int, int] | None]:
    """Stage data, rendezvous once, run the ranks, deliver rank 0's result; returns (outcome or
    None when stopped, the channel error if this node never reached the driver, how the result
    was delivered if it already was)."""
    node = _Node(spec, context, workdir)
    rows = 0
    data_path = None
    if spec.data is not None:
        data_path, rows = write_node_data(batches, workdir.path)
    else:
        for _ in batches:  # the input rows only shape the stage; one per node
            pass
    reservation = reserve_port(node.master_host) if node.rank == 0 else None
    store = None
    channel_error = None
    try:
        port = reservation.getsockname()[1] if reservation is not None else 0
        if reservation is not None:  # listening before any node's rank can ask for it
            store = start_store_host(spec, port, spec.cwd if spec.cwd and os.path.isdir(spec.cwd) else None)
        hello = {"port": port, "python": platform.python_version(), "rows": rows}
        peers = node.rendezvous(hello)
        if node.channel is not None and not node.channel.connected_ever:
            channel_error = node.channel.last_error or "no connection"
        if peers is None:
            return None, channel_error, None
        sink = node.sink()
        error, warning = python_mismatch(spec.driver_python, [str(p.get("python")) for p in peers])
        if error:
            raise node.fail(error)
        if warning and node.rank == 0:
            sink(-1, "stderr", warning)
        node_env: dict[str, str] = {}
        if spec.data is not None and data_path is not None:
            rows_per_node = [int(p["rows"]) for p in peers]
            problem = check_shards(rows_per_node, spec.plan.procs_per_node)
            if problem:
                raise node.fail(problem, kind="ConfigurationError")
            node_env.update(data_env(data_path, spec.data.columns, spec.data.explicit, rows_per_node=rows_per_node))
        if spec.script is not None and not os.path.isfile(spec.script):
            raise node.fail(
                f"training script {spec.script} does not exist on executor host {node.host}; "
                "in distributed mode the script must be at the same path on every executor "
                "(a shared filesystem, or ship it with spark.files / --files)"
            )
        visible = ""  # without GPUs the ranks see none (as with TorchDistributor)
        if spec.plan.use_gpu:
            per_node = spec.plan.procs_per_node
            if spec.plan.local_gpus:  # a local master: this node's share of the driver's GPUs
                mine = node_gpus(spec.plan.local_gpus, node.rank, per_node)
            else:
                assigned = list(context.resources()["gpu"].addresses)[:per_node]
                try:
                    mine = through_visible(assigned, os.environ.get("CUDA_VISIBLE_DEVICES"))
                except ClusterConfigurationError as exc:
                    raise node.fail(f"on executor host {node.host}: {exc}", kind="ConfigurationError") from None
            visible = ",".join(mine)
        node_env.update(resume_env(spec, workdir.path))
        reports = None
        if node.channel is not None:
            reports = node.channel.reports = NodeReports(node.rank, forward=node.channel.forward_report)
        node_spec = NodeSpec(
            run=spec,
            node_rank=node.rank,
            master_addr=node.master_host,
            master_port=int(peers[0]["port"]),
            host=node.host,
            visible_devices=visible,
            node_env=node_env,
            cwd=spec.cwd if spec.cwd and os.path.isdir(spec.cwd) else None,
            agent_store=store is not None,
        )
        channel = node.channel

        def first_failure(failure: RankFailure, blob: str | None) -> None:
            if channel is not None:  # the driver hears it before Spark's own report of any task
                channel.send_failure(FailureReport(failures=(failure,), pickled={failure.rank: blob} if blob else {}), None)

        try:
            outcome, pickled = run_node(
                node_spec, sink, stop=node.stop, workdir=workdir, reports=reports, on_failure=first_failure
            )
        finally:
            if reports is not None:
                reports.close()
        delivered = None
        if outcome.result_file is not None and not outcome.stopped and not outcome.failures:
            delivered = _deliver_result(spec, outcome.result_file, node.channel)
        if outcome.failures and node.channel is not None:
            # over the channel too: the driver then hears every failed node and puts the
            # earliest failure first, whichever task Spark saw failing first
            failed = FailureReport(failures=tuple(outcome.failures), pickled={r: p for r, p in pickled.items() if p})
            node.channel.send_failure(failed)
    finally:
        if node.channel is not None:
            node.channel.close()
        if store is not None:
            store.close()
        if reservation is not None:
            reservation.close()
    if outcome.stopped:
        return None, channel_error, None
    if outcome.failures:
        raise node.failed(outcome.failures, pickled)
    return outcome, channel_error, delivered
