"""Driver side of distributed mode: one Spark barrier stage, one task per node.

Opens the run's channel, starts the stage (``mapInArrow(..., barrier=True)``, which also works
under Spark Connect) in its own tagged job so it can be cancelled, waits for it within the
attempt's time, and returns how the attempt ended: rank 0's result (rows and files:
:mod:`spark_torch.node.result_transfer`) or the typed cause of its end
(:mod:`spark_torch.driver.run.outcome`; the controller makes the user's error of it).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from dataclasses import replace
from typing import Any

from spark_torch.base.background import BackgroundCall
from spark_torch.base.grace import DRIVER_STOP_WAIT_SECONDS
from spark_torch.base.states import ProblemKind, ShardSource, StopReason
from spark_torch.channel.driver_end import DriverChannel, new_secret
from spark_torch.driver.run.attempt import Attempt
from spark_torch.driver.run.classify import AttemptEvidence, TimeUp, Verdict, classify
from spark_torch.driver.run.endpoints import ChannelEndpoint
from spark_torch.driver.run.membership import GrowWatch
from spark_torch.driver.run.outcome import AttemptOutcome, Interrupted, StartProblem
from spark_torch.driver.run.stall import StallWatch, note_stacks
from spark_torch.driver.spark.cluster import executor_hosts
from spark_torch.driver.spark.dataframe import DataInput
from spark_torch.driver.spark.pyspark_shims import cancel_tagged_job, collect_arrow, tagged_job
from spark_torch.driver.spark.shipping import ship_package
from spark_torch.driver.spark.staged_reuse import KeptRows
from spark_torch.ft.rank_ends import rank_ended
from spark_torch.node import result_transfer
from spark_torch.node.task import run_barrier_task
from spark_torch.node.workdir import NodeWorkdir
from spark_torch.reporting.coordinator import ReportCoordinator
from spark_torch.shared.rank_files import ResultBytes
from spark_torch.shared.sealed import find_sealed
from spark_torch.shared.spec import RunSpec
from spark_torch.shared.workdir_files import WorkdirFiles

__all__ = ["run_distributed"]

logger = logging.getLogger(__name__)

#: after cancelling the Spark job, how long to wait for the job thread to return
CANCEL_WAIT_SECONDS = 30.0
#: after the job, how long to wait for the nodes' last lines
DRAIN_SECONDS = 10.0


def _open_channel(
    attempt: Attempt, endpoint: ChannelEndpoint, trusted_hosts: set[str] | None = None, **handlers: Any
) -> DriverChannel:
    """Bind the run's channel (raises OSError); ``trusted_hosts`` (the executors' addresses)
    get handshake slots strangers cannot take, ``handlers`` are what it hands on."""
    return DriverChannel(
        attempt.on_lines,
        nodes=attempt.spec.plan.num_nodes,
        bind_host=endpoint.bind_host,
        advertise_host=endpoint.advertise_host,
        advertise_port=endpoint.advertise_port,
        secret=new_secret(),
        ports=endpoint.ports,
        heartbeat=endpoint.heartbeat,
        rendezvous_timeout=endpoint.rendezvous_timeout,
        trusted_hosts=trusted_hosts or (),
        **handlers,
    )


def _bind_problem(endpoint: ChannelEndpoint, exc: OSError) -> str:
    """Which address could not be bound, and what to change."""
    return (
        f"spark_torch could not listen for its channel on {endpoint.bind_host}"
        f"{f' (ports {endpoint.ports[0]}-{endpoint.ports[1]})' if endpoint.ports else ''}: {exc}. "
        "The address comes from spark.driver.bindAddress, else spark.driver.host, else "
        "SPARK_TORCH_CHANNEL_HOST; it must be an address of this machine. Free or widen the port "
        "range (SPARK_TORCH_CHANNEL_PORTS / spark.torch.channel.ports) if one is set"
    )


def run_distributed(
    spark: Any, attempt: Attempt, endpoint: ChannelEndpoint, data: DataInput | None = None
) -> AttemptOutcome:
    """Run the barrier stage; every way the attempt ends is returned: succeeded (rank 0's
    pickled result in function mode), grow requested, or the typed cause of its failure. With
    ``reuse_staged`` and rows kept by an earlier run, the stage's input is one placeholder row
    per node and each node takes a kept shard of its executor; when they do not cover every
    node, a second stage stages them from the DataFrame again."""
    spec = attempt.spec
    if spec.settings.ship_package:
        try:
            ship_package(spark)
        except Exception as exc:  # noqa: BLE001 - the nodes still check that they run the driver's code
            logger.warning("spark_torch: could not ship spark_torch to the executors (%s); they use their own", exc)
    if data is None or data.digest is None or spec.data is None:
        return _run_stage(spark, attempt, endpoint, data)
    kept = KeptRows.for_attempt(spark, data.digest, data.columns, data.explicit, spec.plan)
    cache, missed, started = kept.first(), False, time.monotonic()
    while True:
        here = replace(attempt, spec=replace(spec, data=replace(spec.data, cache=cache)))
        outcome = _run_stage(spark, here, endpoint, None if cache.reuse else data)
        shards = outcome.shards
        if cache.reuse and any(use.source is ShardSource.MISSED for use in shards.values()):
            cache, missed = kept.missed(cache), True
            left = attempt.timeout - (time.monotonic() - started) if attempt.timeout is not None else None
            attempt = replace(attempt, timeout=max(left, 0.0) if left is not None else None)
            continue
        return replace(outcome, staging=kept.settle(cache, shards, spec.plan.num_nodes, missed))


def _run_stage(spark: Any, attempt: Attempt, endpoint: ChannelEndpoint, data: DataInput | None) -> AttemptOutcome:
    """One barrier stage (``data``: the DataFrame as its input; None: a placeholder row per
    node); how it ended (with each node's outcome: where its rows came from)."""
    spec = attempt.spec
    by_file = spec.payload is not None and spec.settings.result_transfer != "spark"
    with contextlib.ExitStack() as cleanup:
        streamed = None
        if by_file:
            # node 0 moves rank 0's result in here when it shares this host (or filesystem), or
            # streams it over the channel into a file here
            result_dir = cleanup.enter_context(NodeWorkdir(spec.run_id, 0, role="driver"))
            streamed = result_transfer.StreamedResult(WorkdirFiles(result_dir.path).streamed_result())
            cleanup.callback(streamed.close)
            spec = replace(
                spec, result_dir=result_dir.path, result_token=result_transfer.prepare_result_dir(result_dir.path)
            )
        stage = _BarrierStage(spark, spec, attempt, data, streamed)
        cleanup.callback(stage.close)
        problem = stage.open(endpoint)
        if problem is not None:
            return AttemptOutcome.ended(problem)
        stage.start()
        return classify(stage.gather_evidence(stage.wait()))
    raise AssertionError("unreachable")  # pragma: no cover - for type checkers: the block returns


class _BarrierStage:
    """One attempt's barrier stage, in three steps: :meth:`start` the job, :meth:`wait` for it
    within the attempt's time (stopping it on a timeout, a stall or an interrupt), and
    :meth:`gather_evidence` of how it ended (stopping the nodes Spark did not stop, waiting for
    the nodes' ends), which :func:`~spark_torch.driver.run.classify.classify` decides on, as in
    local mode. :meth:`close` releases what :meth:`open` made."""

    def __init__(
        self,
        spark: Any,
        spec: RunSpec,
        attempt: Attempt,
        data: DataInput | None,
        streamed: result_transfer.StreamedResult | None,
    ) -> None:
        self.spark, self.spec, self.attempt, self.data, self.streamed = spark, spec, attempt, data, streamed
        self.plan = spec.plan
        #: the job ended, or the stall watch stopped the attempt
        self.wake = threading.Event()
        self.channel: DriverChannel | None = None
        self.grow: GrowWatch | None = None
        self.coordinator: ReportCoordinator | None = None
        self.stall: StallWatch | None = None
        self.stall_open = True  # closed once the wait is over (or by close())
        self.job: BackgroundCall[Any] | None = None

    def _channel(self) -> DriverChannel:
        assert self.channel is not None, "the stage's channel is opened first"
        return self.channel

    def open(self, endpoint: ChannelEndpoint) -> StartProblem | None:
        """Open the run's channel with what it hands on (report() steps, rank 0's streamed
        result, the ranks' progress); a problem when its address cannot be bound."""
        attempt, plan = self.attempt, self.plan
        self.stall = attempt.stall_watch(
            stop=lambda reason: self.wake.set(),
            request_traces=lambda stopping: self._channel().request_traces(stopping),
        )
        membership = attempt.membership
        if membership is not None and plan.num_nodes < membership.max_nodes:
            self.grow = GrowWatch(
                self.spark, plan.num_nodes, membership, lambda reason: self._channel().stop_nodes(reason)
            )
        self.coordinator = attempt.report_coordinator(
            answer=lambda step, error: self._channel().answer_reports(step, error),
            after_checkpoint=self.grow.checkpointed if self.grow is not None else None,
        )
        try:
            self.channel = _open_channel(
                attempt,
                endpoint,
                executor_hosts(self.spark),
                reports=self.coordinator,
                bulk_sink=self.streamed,
                on_progress=self.stall.update,
                on_trace=self.stall.trace,
                # a replica group's lighthouse hears of a failed rank at once (spark_torch.ft.rank_ends)
                on_outcome=lambda node, outcome: rank_ended(self.spec.run_id) if outcome.failures else None,
            )
        except OSError as exc:
            return StartProblem.of(
                ProblemKind.CONFIGURATION, _bind_problem(endpoint, exc), cause=exc
            )  # close() ends the rest
        self.spec = replace(self.spec, channel=self.channel.spec)
        return None

    def start(self) -> None:
        """Start the barrier job (one task per node) and the channel's rendezvous clock."""
        spark, spec, plan, data = self.spark, self.spec, self.plan, self.data
        # one input partition per node: the node's share of the data, or one placeholder row
        source = (
            data.df.select(*data.columns).repartition(plan.num_nodes)
            if data is not None
            else spark.range(0, plan.num_nodes, 1, plan.num_nodes)
        )
        df = source.mapInArrow(functools.partial(run_barrier_task, spec), result_transfer.RESULT_SCHEMA, barrier=True)
        tag = self.attempt.tag

        def collect() -> Any:
            with tagged_job(spark, tag):
                return collect_arrow(df)

        self.job = BackgroundCall(collect, name=tag, on_done=self.wake.set).start()
        self._channel().start_rendezvous_clock()

    def _cancel(self, reason: StopReason) -> None:
        """Stop every node's ranks, then the Spark job."""
        assert self.stall is not None and self.job is not None
        self.stall.freeze()  # where the ranks were, not where they are while stopping
        channel = self._channel()
        channel.stop_nodes(reason)
        try:
            # the nodes give their ranks SIGTERM and a grace period; cancelling the Spark job
            # first would kill the Python workers, and with them the ranks, at once
            channel.wait_for_nodes(timeout=DRIVER_STOP_WAIT_SECONDS)  # their ranks' grace, then cancel
        finally:
            cancel_tagged_job(self.spark, self.attempt.tag)
            self.job.wait(CANCEL_WAIT_SECONDS)

    def wait(self) -> Verdict:
        """Until the job ended, the stall watch stopped the attempt, or the attempt's time is up:
        the driver's verdict when it stopped the attempt (every node's ranks stopped and the job
        cancelled), None when the job ended by itself."""
        stall, job, attempt, plan = self.stall, self.job, self.attempt, self.plan
        assert stall is not None and job is not None
        cancellation, cancelled = attempt.cancellation, threading.Event()

        def cancel() -> None:
            cancelled.set()
            self.wake.set()

        try:
            try:
                with cancellation.watch(cancel) if cancellation is not None else contextlib.nullcontext():
                    self.wake.wait(attempt.timeout)
            except BaseException as interrupt:  # Ctrl-C (or anything else): stop every node first
                note_stacks(interrupt, stall)
                self._cancel(StopReason.CANCELLED)
                if isinstance(interrupt, KeyboardInterrupt):
                    return Interrupted(interrupt)
                raise
            if job.done:
                return None
            if (
                cancelled.is_set() and cancellation is not None and cancellation.error is not None
            ):  # from another thread
                self._cancel(StopReason.CANCELLED)
                return Interrupted(cancellation.error)
            if stall.failed.is_set():
                verdict = stall.verdict()
                self._cancel(verdict.reason)
                return verdict
            self._cancel(StopReason.TIMEOUT)
            per_node = plan.procs_per_node
            node_ranks = {node: range(node * per_node, (node + 1) * per_node) for node in range(plan.num_nodes)}
            return TimeUp(
                attempt.run_timeout, node_ranks, attempt.tail, stall.stacks(), note="the Spark job was cancelled; "
            )
        finally:
            self._close_stall()

    def _close_stall(self) -> None:
        stall, self.stall_open = self.stall, False
        if stall is not None:
            stall.close()

    def gather_evidence(self, verdict: Verdict) -> AttemptEvidence:
        """What the ended job left, for :func:`~spark_torch.driver.run.classify.classify`: after a
        failed job, the nodes Spark did not stop yet are stopped and waited for (their ranks'
        grace); then every node's end as the channel, Spark's error text and the task rows say it
        (each sealed with the run's secret), the driver's ``verdict``, the grow request, Spark's
        error, and how to read rank 0's result."""
        channel, job, spec, plan = self._channel(), self.job, self.spec, self.plan
        assert job is not None and spec.channel is not None
        secret = spec.channel.secret
        grow = self.grow.requested if self.grow is not None else None
        spark_error = None
        if verdict is None and grow is not None:
            channel.wait_for_nodes(timeout=DRAIN_SECONDS)  # the nodes stopped after a checkpoint: restart larger
        elif verdict is None and job.error is not None:
            channel.stop_nodes(StopReason.PEER_FAILED)  # the nodes Spark did not stop yet
            channel.wait_for_nodes(timeout=DRIVER_STOP_WAIT_SECONDS)  # other failed nodes' ends, their ranks stopped
            spark_error = job.error
        elif verdict is None:
            channel.wait_for_nodes(timeout=DRAIN_SECONDS)  # drain the last log lines
        outcomes = channel.node_outcomes()
        if spark_error is not None:  # a failed node's end, also when it never reached the channel
            for node, outcome in find_sealed(str(spark_error), secret).items():
                outcomes[node] = outcome.after(outcomes[node]) if node in outcomes else outcome
        stage = result_transfer.read_stage(job.value, secret) if job.value is not None else None
        if stage is not None:
            if verdict is None and grow is None:
                channel.connect_errors(stage.channel_errors)
            outcomes.update(stage.outcomes)

        def result() -> ResultBytes | None:
            if spec.payload is None or stage is None:
                return None
            return result_transfer.assemble(stage, spec.result_dir, self.streamed)

        return AttemptEvidence(
            plan.num_nodes,
            outcomes,
            verdict,
            grow=grow if verdict is None else None,
            spark_error=spark_error,
            result=result,
            dataframe=self.data is not None,
            returned=set(stage.outcomes) if stage is not None else set(),
        )

    def close(self) -> None:
        """Stop the grow watch (and the stall watch if no wait closed it), close the channel and
        the report coordinator."""
        if self.stall_open:
            self._close_stall()
        if self.grow is not None:
            self.grow.close()
        if self.channel is not None:
            self.channel.close()
        if self.coordinator is not None:
            self.coordinator.close()
