"""Executor side of distributed mode: the body of one Spark barrier task (one node).

The node runner (:func:`~spark_torch.node.lifecycle.run_node`) runs the node; this module gives it a
:class:`BarrierIO`: the rendezvous goes through the driver's channel (each node says hello;
node 0's hello carries the port it reserved), or, when the channel cannot be reached within the
rendezvous deadline, through one Spark ``allGather`` round (about a second); rank output goes
to the channel, or to the executor's log. Rank 0's result goes back as the stage's rows
(:mod:`spark_torch.node.result_transfer`). How the node ended, its
:class:`~spark_torch.shared.node_outcome.NodeOutcome`, is sealed with the run's secret
(:mod:`spark_torch.shared.sealed`) and sent over the channel when the driver is reached, and also
returned as a row, or, when its ranks failed or could not start, raised inside a task exception:
Spark then aborts the barrier stage at once (a barrier result stage is never retried), kills the
other tasks and hands the text to the driver. Imports no driver-side module.
"""

from __future__ import annotations

import json
import socket
import sys
from collections.abc import Iterator
from typing import Any

from spark_torch.base.background import BackgroundCall
from spark_torch.base.states import GroupState, ProblemKind, RankState, StopSignal
from spark_torch.channel.node_end import NodeChannel
from spark_torch.errors import RankFailure
from spark_torch.node import result_transfer
from spark_torch.node.lifecycle import NodeProblem, host_of, run_node
from spark_torch.node.progress import ProgressWatch
from spark_torch.node.storage_check import storage_hello, storage_needed, storage_problem
from spark_torch.node.workdir import NodeWorkdir
from spark_torch.reporting.pipes import NodeReports
from spark_torch.shared.lines import RankOutput
from spark_torch.shared.node_outcome import NodeOutcome
from spark_torch.shared.sealed import seal
from spark_torch.shared.spec import RunSpec

__all__ = ["run_barrier_task", "BarrierIO", "NodeFailed"]


class NodeFailed(RuntimeError):
    """Raised in the task so that Spark aborts the barrier stage; carries the node's sealed end."""


class ExecutorLog:
    """Without a driver channel, rank output goes to the executor's stderr log."""

    def __call__(self, rank: int, stream: str, block: str) -> None:
        prefix = f"[rank {rank}] "
        sys.stderr.write(prefix + block.replace("\n", "\n" + prefix) + "\n")

    def flush(self) -> None:
        sys.stderr.flush()

    def rank_event(self, rank: int, state: RankState) -> None:
        """Nobody watches rank states here."""


class BarrierIO:
    """A node inside a Spark barrier task (see :class:`~spark_torch.node.lifecycle.NodeIO`)."""

    def __init__(self, spec: RunSpec, context: Any) -> None:
        self.spec = spec
        self.context = context
        #: node 0: the default storage is not visible from some nodes (their checkpoints would fail)
        self._storage_warning: str | None = None
        self.node_rank: int = context.partitionId()
        infos = context.getTaskInfos()
        self.master_host = host_of(infos[0].address)
        self.host = host_of(infos[self.node_rank].address) or socket.gethostname()
        self.first_rank = self.node_rank * spec.plan.procs_per_node
        self.stop = StopSignal()
        #: this node's report() pipes and progress watch, once its ranks started
        self._reports: NodeReports | None = None
        self._progress: ProgressWatch | None = None
        self.channel = (
            NodeChannel(
                spec.channel,
                self.node_rank,
                spec.plan.num_nodes,
                self.stop,
                reports=self,
                on_trace_request=self._trace_request,
            )
            if spec.channel is not None
            else None
        )

    # NodeIO
    def rendezvous(self, hello: dict[str, Any]) -> list[dict[str, Any]] | None:
        """Every node's hello in node order; None if stopped. Raises :class:`NodeProblem` when a
        storage the run needs is not visible from every node (:mod:`spark_torch.node.storage_check`)."""
        peers = self._meet({**hello, **storage_hello(self.spec)})
        problem = storage_problem(self.spec, peers) if peers is not None else None
        if problem is not None and storage_needed(self.spec):
            raise NodeProblem(problem, kind=ProblemKind.CONFIGURATION)
        if problem is not None and self.node_rank == 0:  # the default storage: checkpoints would fail
            self._storage_warning = f"[spark_torch] WARNING: report(checkpoint=...) will fail on these nodes: {problem}"
        return peers

    def _meet(self, hello: dict[str, Any]) -> list[dict[str, Any]] | None:
        """Every node's hello in node order, through the channel or Spark's allGather; None if stopped."""
        reason = "the run has no driver channel"
        if self.channel is not None:
            met = self.channel.rendezvous(hello)
            if met.stopped:
                return None
            if met.peers is not None:
                return met.peers
            reason = met.reason
        return self._all_gather({**hello, "node": self.node_rank}, reason)

    def _all_gather(self, hello: dict[str, Any], reason: str) -> list[dict[str, Any]]:
        timeout = self.spec.channel.rendezvous_timeout if self.spec.channel is not None else 60.0
        where = self.spec.channel.address if self.spec.channel is not None else "(none)"
        gather = BackgroundCall(lambda: list(self.context.allGather(json.dumps(hello))), name="spark-torch-allgather")
        finished = gather.start().wait(timeout)
        if not finished or gather.error is not None:
            detail = f"failed ({gather.error})" if finished else f"did not complete within {timeout:g}s"
            raise NodeProblem(
                f"the nodes could not rendezvous: the driver's channel at {where} was not usable ({reason}) "
                f"and the Spark barrier allGather fallback {detail}. Make {where} reachable from the "
                "executors (spark.driver.host / SPARK_TORCH_CHANNEL_HOST, SPARK_TORCH_CHANNEL_PORTS for a "
                "firewall); see docs/troubleshooting.md"
            )
        return [json.loads(m) for m in gather.value or ()]

    def output(self) -> RankOutput:
        """The driver's channel if this node reaches it, else the executor log."""
        sink: RankOutput = (
            self.channel if self.channel is not None and self.channel.detach_if_unreachable() else ExecutorLog()
        )
        if self._storage_warning is not None:  # said once, before any rank's line
            sink(-1, "stderr", self._storage_warning)
        return sink

    def task_gpus(self) -> list[str]:
        return list(self.context.resources()["gpu"].addresses)

    def report_pipes(self, ranks: range) -> NodeReports | None:
        if self.channel is None:
            return None
        self._reports = NodeReports(self.node_rank, ranks, forward=self.channel.forward_report)
        return self._reports

    def persisted(self, step: int, error: str | None = None) -> None:
        """The driver's answer to a report() step (the channel's ``reports``): to the ranks' pipes."""
        if self._reports is not None:
            self._reports.persisted(step, error)

    def _trace_request(self, stopping: bool) -> None:
        """The driver asks for the ranks' Flight Recorder traces (the channel's ``on_trace_request``)."""
        if self._progress is not None:
            self._progress.request_traces(stopping)

    def rank_failed(self, failure: RankFailure, pickled: str | None) -> None:
        if self.channel is not None:  # the driver hears it before Spark's own report of any task
            first = NodeOutcome(
                GroupState.FAILED, failures=(failure,), pickled={failure.rank: pickled} if pickled else {}
            )
            self.channel.send_outcome(first, wait=None)

    def progress(self, stacks: list[dict[str, Any]]) -> None:
        channel = self.channel
        if channel is not None and channel.usable:
            channel.send_progress(stacks)

    def trace(self, rank: int, data: bytes) -> None:
        channel = self.channel
        if channel is not None and channel.usable:
            channel.send_trace(rank, data)

    def watching(self, watch: ProgressWatch) -> None:
        self._progress = watch

    # the task's own ends
    def channel_error(self) -> str | None:
        """The last error of a node that never reached the driver's channel."""
        if self.channel is not None and not self.channel.connected_ever:
            return self.channel.last_error or "no connection"
        return None

    @property
    def secret(self) -> bytes:
        """The run's secret (empty without a channel): what the node's end is sealed with."""
        return self.spec.channel.secret if self.spec.channel is not None else b""

    def send_outcome(self, outcome: NodeOutcome) -> None:
        """How this node's part ended, to the driver over the channel (when it reaches the driver;
        a failed node waits a little for the driver to have it, before Spark stops the others)."""
        if self.channel is not None:
            self.channel.send_outcome(outcome, wait=2.0 if outcome.failed else None)

    def failed(self, outcome: NodeOutcome) -> NodeFailed:
        """The task exception of a node whose ranks failed or could not start: a line for people
        reading Spark's UI and logs, then the node's sealed end, which alone the driver trusts."""
        if outcome.problem is not None:
            return NodeFailed(f"{outcome.problem.message}\n{seal(self.node_rank, outcome, self.secret)}")
        root = outcome.failures[0] if outcome.failures else None
        what = (
            f"rank {root.rank} on {self.host} failed: {root.cause()[:2000]}" if root else f"{self.host}: ranks failed"
        )
        return NodeFailed(f"{what} (report for the driver follows)\n{seal(self.node_rank, outcome, self.secret)}")

    def close(self) -> None:
        """Send what is queued, then close the channel (once)."""
        channel, self.channel = self.channel, None
        if channel is not None:
            channel.close()


def run_barrier_task(spec: RunSpec, batches: Iterator[Any]) -> Iterator[Any]:
    """``mapInArrow`` body: one node of the run."""
    from pyspark import BarrierTaskContext

    io = BarrierIO(spec, BarrierTaskContext.get())
    delivered = None
    try:  # the channel connects from here on: it is closed whatever happens next
        with NodeWorkdir(spec.run_id, io.node_rank) as workdir:
            try:
                hosted = run_node(spec, io, workdir, batches)
                outcome = hosted.outcome()
            except NodeProblem as problem:
                hosted, outcome = None, problem.outcome()
            channel_error = io.channel_error()
            io.send_outcome(outcome)  # how its ranks ended (the failures), the stop's reason, its problem
            if outcome.problem is not None or outcome.failed:
                raise io.failed(outcome) from None
            group = hosted.group if hosted is not None else None
            result_file = group.result_file if outcome.finished and group is not None else None
            if result_file is not None:
                delivered = result_transfer.deliver(spec, result_file, io.channel)
            io.close()  # sends the last lines (bounded) before the rows go back
            yield from result_transfer.node_rows(
                io.node_rank,
                outcome,
                io.secret,
                channel_error=channel_error,
                delivered=delivered,
                result_file=result_file,
            )
    finally:
        io.close()
