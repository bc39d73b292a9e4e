"""Driver side of distributed mode: one Spark barrier stage, one task per node.

Opens the run's channel, starts the stage (``mapInArrow(..., barrier=True)``, which also works
under Spark Connect) in its own tagged job so it can be cancelled, waits for it within the
attempt's time, and turns what came back into rank 0's result (rows and files:
:mod:`spark_torch.node.result_transfer`) or the user's error (:mod:`spark_torch.driver.run.failures`).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from dataclasses import replace
from typing import Any

from spark_torch.channel.driver_end import DriverChannel, new_secret
from spark_torch.driver.result import AttemptEnd
from spark_torch.driver.run.attempt import Attempt, AttemptOutcome
from spark_torch.driver.run.endpoints import ChannelEndpoint
from spark_torch.driver.run.failures import error_from_spark_failure, timeout_error
from spark_torch.driver.run.membership import GrowWatch
from spark_torch.driver.run.stall import note_stacks
from spark_torch.driver.spark.cluster import executor_hosts
from spark_torch.driver.spark.dataframe import DataInput
from spark_torch.driver.spark.pyspark_shims import cancel_tagged_job, collect_arrow, tagged_job
from spark_torch.driver.spark.shipping import ship_package
from spark_torch.errors import ConfigurationError, LaunchError, RankFailure
from spark_torch.grace import DRIVER_STOP_WAIT_SECONDS
from spark_torch.node import result_transfer
from spark_torch.node.task import run_barrier_task
from spark_torch.node.workdir import NodeWorkdir
from spark_torch.spec import RunSpec

__all__ = ["run_distributed", "completed_while_stopping"]

logger = logging.getLogger(__name__)

#: after cancelling the Spark job, how long to wait for the job thread to return
CANCEL_WAIT_SECONDS = 30.0
#: after the driver stopped the nodes (timeout, Ctrl-C), how long they may take to stop their
#: ranks gracefully before the Spark job is cancelled (derived from the nodes' grace)
STOP_GRACE_SECONDS = DRIVER_STOP_WAIT_SECONDS
#: after a failed job, how long to wait for the other nodes' failure reports over the channel,
#: and for their ranks to stop before a restart (derived from the nodes' grace)
FAILURE_REPORTS_SECONDS = DRIVER_STOP_WAIT_SECONDS
#: after the job, how long to wait for the nodes' last lines
DRAIN_SECONDS = 10.0


def _collect(df: Any, spark: Any, tag: str, box: dict[str, Any], done: threading.Event, wake: threading.Event) -> None:
    try:
        with tagged_job(spark, tag):
            box["table"] = collect_arrow(df)
    except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
        box["error"] = exc
    finally:
        done.set()
        wake.set()


def _open_channel(attempt: Attempt, endpoint: ChannelEndpoint, trusted_hosts: set[str] | None = None) -> DriverChannel:
    """Bind the run's channel, or say which address could not be bound and what to change;
    ``trusted_hosts`` (the executors' addresses) get handshake slots strangers cannot take."""
    try:
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
        )
    except OSError as exc:
        raise ConfigurationError(
            f"spark_torch could not listen for its channel on {endpoint.bind_host}"
            f"{f' (ports {endpoint.ports[0]}-{endpoint.ports[1]})' if endpoint.ports else ''}: {exc}. "
            "The address comes from spark.driver.bindAddress, else spark.driver.host, else "
            "SPARK_TORCH_CHANNEL_HOST; it must be an address of this machine. Free or widen the port "
            "range (SPARK_TORCH_CHANNEL_PORTS / spark.torch.channel.ports) if one is set"
        ) from exc


def run_distributed(
    spark: Any, attempt: Attempt, endpoint: ChannelEndpoint, data: DataInput | None = None
) -> AttemptOutcome:
    """Run the barrier stage: succeeded (rank 0's pickled result in function mode) or grow
    requested; raises the run's errors (failure, timeout, interruption)."""
    plan = attempt.spec.plan
    if plan.local_mode:  # pragma: no cover - guarded by the caller
        raise ConfigurationError("run_distributed called with a local-mode plan")
    by_file = attempt.spec.payload is not None and attempt.spec.settings.result_transfer != "spark"
    if attempt.spec.settings.ship_package:
        try:
            ship_package(spark)
        except Exception as exc:  # noqa: BLE001 - the nodes still check that they run the driver's code
            logger.warning("spark_torch: could not ship spark_torch to the executors (%s); they use their own", exc)
    channel = _open_channel(attempt, endpoint, executor_hosts(spark))
    grow = None
    if attempt.membership is not None and plan.num_nodes < attempt.membership.max_nodes:
        grow = GrowWatch(spark, plan.num_nodes, attempt.membership, channel.stop_nodes)
    coordinator = channel.reports = attempt.report_coordinator(
        answer=channel.answer_reports, after_checkpoint=grow.checkpointed if grow is not None else None
    )
    streamed = None
    try:
        spec = replace(attempt.spec, channel=channel.spec)
        if not by_file:
            return _run_stage(spark, spec, attempt, channel, data, None, grow)
        # node 0 moves rank 0's result in here when it shares this host (or filesystem), or
        # streams it over the channel into a file here
        with NodeWorkdir(spec.run_id, 0, role="driver") as result_dir:
            streamed = channel.bulk_sink = result_transfer.StreamedResult(
                os.path.join(result_dir.path, result_transfer.STREAMED_RESULT_FILE)
            )
            token = result_transfer.prepare_result_dir(result_dir.path)
            spec = replace(spec, result_dir=result_dir.path, result_token=token)
            return _run_stage(spark, spec, attempt, channel, data, streamed, grow)
    finally:
        if grow is not None:
            grow.close()
        channel.close()
        coordinator.close()
        if streamed is not None:
            streamed.close()


def completed_while_stopping(box: dict[str, Any], num_nodes: int) -> bool:
    """Whether a job the driver was stopping (timeout, stall) had completed the run after all:
    every node's rows say it finished. A node that was stopped returns normally, without that
    row, so the job can end without an error before the cancel reaches Spark: that is the
    stop's outcome, not a completed run (once read as "only 0 of 2 tasks reported back")."""
    table = box.get("table")
    return table is not None and len(result_transfer.read_stage(table).finished) >= num_nodes


def _run_stage(
    spark: Any,
    spec: RunSpec,
    attempt: Attempt,
    channel: DriverChannel,
    data: DataInput | None,
    streamed: result_transfer.StreamedResult | None,
    grow: GrowWatch | None = None,
) -> AttemptOutcome:
    plan = spec.plan
    # one input partition per node: the node's share of the data, or one placeholder row
    source = (
        data.df.select(*data.columns).repartition(plan.num_nodes)
        if data is not None
        else spark.range(0, plan.num_nodes, 1, plan.num_nodes)
    )
    df = source.mapInArrow(functools.partial(run_barrier_task, spec), result_transfer.RESULT_SCHEMA, barrier=True)
    tag = attempt.tag
    box: dict[str, Any] = {}
    done = threading.Event()  # the Spark job ended
    wake = threading.Event()  # the job ended, or the stall watch stopped the attempt
    stall = attempt.stall_watch(stop=lambda reason: wake.set())
    channel.on_progress = stall.update
    channel.on_trace = stall.trace
    stall.request_traces = channel.request_traces
    worker = threading.Thread(target=_collect, args=(df, spark, tag, box, done, wake), name=tag, daemon=True)
    worker.start()
    channel.start_rendezvous_clock()

    def cancel(reason: str) -> None:
        stall.freeze()  # where the ranks were, not where they are while stopping
        channel.stop_nodes(reason)
        try:
            # the nodes give their ranks SIGTERM and a grace period; cancelling the Spark job
            # first would kill the Python workers, and with them the ranks, at once
            channel.wait_for_nodes(timeout=STOP_GRACE_SECONDS)
        finally:
            cancel_tagged_job(spark, tag)
            done.wait(CANCEL_WAIT_SECONDS)

    try:
        try:
            wake.wait(attempt.timeout)
        except BaseException as interrupt:  # KeyboardInterrupt: stop every node, then re-raise
            stall.freeze()
            note_stacks(interrupt, stall)
            cancel("cancelled on the driver")
            raise
        finished = done.is_set()
        if not finished and stall.failed.is_set():
            cancel("the run stalled (stall_action='fail')")
            if not completed_while_stopping(box, plan.num_nodes):
                raise stall.error()
            finished = True
        if not finished:
            cancel("timeout")
        if not finished and not completed_while_stopping(box, plan.num_nodes):
            running = [
                RankFailure(rank=r, host="?", exc_type="still running", exc_message="stopped", last_lines=attempt.tail(r))
                for r in range(plan.world_size)
            ]
            raise timeout_error(
                attempt.run_timeout,
                running,
                f"the Spark job was cancelled and the ranks of all {plan.num_nodes} node(s) were stopped",
                stall.stacks(),
            )
    finally:
        stall.close()
    if grow is not None and grow.requested is not None:  # the nodes stopped after a checkpoint: restart larger
        channel.wait_for_nodes(timeout=DRAIN_SECONDS)
        return AttemptOutcome(AttemptEnd.GROW_REQUESTED, grow=grow.requested)
    if "error" in box:
        channel.stop_nodes("another node failed")  # the nodes Spark did not stop yet
        channel.wait_for_nodes(timeout=FAILURE_REPORTS_SECONDS)  # other failed nodes' reports
        assert spec.channel is not None
        error = error_from_spark_failure(box["error"], spec.channel.secret, list(channel.failures.values()))
        raise error from (error.__cause__ or box["error"])
    channel.wait_for_nodes(timeout=DRAIN_SECONDS)  # drain the last log lines
    stage = result_transfer.read_stage(box["table"])
    channel.connect_errors(stage.channel_errors)
    if len(stage.finished) < plan.num_nodes:
        if data is not None and not stage.finished:
            raise ConfigurationError("the DataFrame is empty; there is nothing to train on")
        raise LaunchError(
            f"only {len(stage.finished)} of {plan.num_nodes} Spark barrier tasks reported back; check the executor logs"
        )
    if spec.payload is None:
        return AttemptOutcome.succeeded(None)
    return AttemptOutcome.succeeded(result_transfer.assemble(stage, spec.result_dir, streamed))
