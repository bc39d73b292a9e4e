"""Driver side of distributed mode: one Spark barrier stage, one task per node."""

from __future__ import annotations

import functools
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from spark_torch.channel.ends import DriverChannel, new_secret
from spark_torch.driver.attempt import Attempt
from spark_torch.driver.cluster import is_connect_session
from spark_torch.driver.compat import cancel_tagged_job, collect_arrow, tagged_job
from spark_torch.driver.dataframe import DataInput
from spark_torch.driver.endpoints import ChannelEndpoint
from spark_torch.envelopes import ResultBytes, map_file, rebuild_exception
from spark_torch.errors import (
    ConfigurationError,
    DistributedRunError,
    InsufficientSlotsError,
    LaunchError,
    RankFailure,
    RunTimeoutError,
)
from spark_torch.failure_reports import FailureReport, decode_report, merge_reports
from spark_torch.node.runner import NodeWorkdir
from spark_torch.node.task import (
    CHANNEL_ERROR_SEQ,
    FINISHED_SEQ,
    HANDED_OVER_SEQ,
    RESULT_FILE,
    RESULT_SCHEMA,
    STREAMED_RESULT_FILE,
    STREAMED_SEQ,
    run_barrier_task,
)
from spark_torch.spec import RunSpec

__all__ = ["run_distributed", "available_slots", "check_slots"]

logger = logging.getLogger(__name__)

#: how long to wait for executors to register before declaring too few slots (cluster masters;
#: cold executor JVMs were seen to take 20-40 s); SPARK_TORCH_EXECUTOR_WAIT overrides it
EXECUTOR_WAIT_SECONDS = 60.0
#: after cancelling the Spark job, how long to wait for the job thread to return
CANCEL_WAIT_SECONDS = 30.0
#: after the driver stopped the nodes (timeout, Ctrl-C), how long they may take to stop their
#: ranks gracefully before the Spark job is cancelled (the node runner's grace is 5 s)
STOP_GRACE_SECONDS = 7.0
#: after a failed job, how long to wait for the other nodes' failure reports over the channel
FAILURE_REPORTS_SECONDS = 3.0


def slots_from_conf(conf: Callable[[str], str | None]) -> int | None:
    """Task slots a cluster offers, from its configuration alone (Spark Connect clients cannot ask
    the scheduler): ``local[N]``, ``local-cluster[N,C,M]``, or a static executor allocation.
    None when the configuration does not say (``local[*]`` on an unknown server, dynamic
    allocation)."""
    try:
        task_cpus = max(1, int(conf("spark.task.cpus") or "1"))
    except ValueError:
        task_cpus = 1
    master = (conf("spark.master") or "").strip()
    if master == "local":
        return 1 // task_cpus
    match = re.fullmatch(r"local\[(\d+)(?:,\d+)?\]", master)
    if match:
        return int(match.group(1)) // task_cpus
    match = re.fullmatch(r"local-cluster\[(\d+),\s*(\d+),\s*\d+\]", master)
    if match:
        return int(match.group(1)) * (int(match.group(2)) // task_cpus)
    if (conf("spark.dynamicAllocation.enabled") or "").lower() == "true":
        return None
    try:
        instances, cores = int(conf("spark.executor.instances") or ""), int(conf("spark.executor.cores") or "")
    except ValueError:
        return None
    return instances * (cores // task_cpus)


def available_slots(spark: Any) -> int | None:
    """Task slots the cluster offers at once for the default resource profile (None: unknown)."""
    if is_connect_session(spark):

        def conf(key: str) -> str | None:
            try:
                value = spark.conf.get(key, None)
            except Exception:  # noqa: BLE001 - an unknown key on some Connect versions
                return None
            return None if value is None else str(value)

        return slots_from_conf(conf)
    jsc = spark.sparkContext._jsc.sc()
    profile = jsc.resourceProfileManager().defaultResourceProfile()
    return int(jsc.maxNumConcurrentTasks(profile))


def check_slots(spark: Any, needed: int) -> None:
    """Fail fast, instead of Spark's ~10 minute retry loop, when the barrier stage cannot fit."""
    slots = available_slots(spark)
    if slots is None or slots >= needed:
        return
    master = str(spark.conf.get("spark.master", "")) if is_connect_session(spark) else spark.sparkContext.master
    if not is_connect_session(spark) and master != "local" and not master.startswith("local["):
        # executors of a fresh cluster register over a few seconds
        wait = float(os.environ.get("SPARK_TORCH_EXECUTOR_WAIT", EXECUTOR_WAIT_SECONDS))
        deadline = time.monotonic() + wait
        while slots is not None and slots < needed and time.monotonic() < deadline:
            time.sleep(0.25)
            slots = available_slots(spark)
        if slots is None or slots >= needed:
            return
    raise InsufficientSlotsError(
        f"distributed mode needs {needed} Spark task slots at once (one barrier task per node), "
        f"but the cluster ({master}) has {slots}. Use num_processes<={slots} (or more GPUs per "
        "task), add executors/cores, lower spark.task.cpus, or use local_mode=True"
    )


#: a node runner that could not even start: an import failed in Spark's Python worker
_MISSING_MODULE = re.compile(r"No module named '([\w.]+)'")


def _failure_from_spark_error(exc: BaseException, secret: bytes, channel_reports: list[FailureReport]) -> BaseException:
    """Turn a Spark job failure into the library's error, from the nodes' authenticated reports:
    those sent over the channel, and the one inside Spark's exception text.

    The exception text also holds whatever the failing rank printed or raised, so only a report
    whose MAC verifies with this run's secret is used (and only then is an exception unpickled).
    """
    text = str(exc)
    from_text = decode_report(text, secret)
    report = merge_reports(channel_reports + ([from_text] if from_text is not None else []))
    if report is not None:
        failures = list(report.failures)
        if report.kind == "LaunchError":
            return LaunchError(failures[0].exc_message if failures else "the ranks could not be started")
        if report.kind == "ConfigurationError":
            return ConfigurationError(failures[0].exc_message if failures else "invalid input")
        error = DistributedRunError(failures, report.headline)
        if error.failures:
            root = error.failures[0]
            cause = rebuild_exception(root, report.pickled.get(root.rank))
            if cause is not None:
                error.__cause__ = cause
        return error
    missing = _MISSING_MODULE.search(text)
    if missing is not None:
        return LaunchError(
            f"the executors' Python cannot import {missing.group(1)}, which spark_torch needs on every "
            "executor: install spark-torch with its dependencies (psutil, fsspec, cloudpickle, pyarrow, "
            "pandas<3) into the executors' Python, or point PYSPARK_PYTHON / spark.pyspark.python at an "
            "interpreter that has them (docs/spark-submit.md)"
        )
    if "requires more slots than the total number of slots" in text:
        return InsufficientSlotsError(
            "the barrier stage needs more task slots than the cluster has free (Spark gave up "
            "after retrying); use fewer processes, add executors/cores, or lower spark.task.cpus"
        )
    lost = next((line for line in text.splitlines() if "ExecutorLostFailure" in line), None)
    if lost is not None:
        detail = lost[lost.index("ExecutorLostFailure"):][:500]
        return DistributedRunError(
            [],
            headline=f"a node of the run was lost: {detail}. Every rank was stopped; check the "
            "executor's logs (memory limits, preemption) and retry, or use max_restarts",
        )
    if "maxResultSize" in text:
        return DistributedRunError(
            [],
            headline="rank 0's result is larger than spark.driver.maxResultSize; raise that Spark "
            "setting when creating the session (e.g. 4g) or return a smaller result "
            "(save large objects to a file and return its path)",
        )
    first = next((line for line in text.splitlines() if line.strip()), text)
    return LaunchError(f"the Spark barrier job failed before the ranks reported: {first[:2000]}")


def _collect(df: Any, spark: Any, tag: str, box: dict[str, Any], done: threading.Event) -> None:
    try:
        with tagged_job(spark, tag):
            box["table"] = collect_arrow(df)
    except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
        box["error"] = exc
    finally:
        done.set()


RESULT_TRANSFERS = ("auto", "channel", "spark")


def _result_transfer() -> str:
    """``SPARK_TORCH_RESULT_TRANSFER``: ``auto`` (default: by file when node 0 can reach the
    driver's temp dir, else streamed over the run's channel, else through Spark), ``channel``
    (the channel even on the driver's host) or ``spark`` (always Spark's result channel)."""
    value = os.environ.get("SPARK_TORCH_RESULT_TRANSFER", "auto").strip().lower()
    if value not in RESULT_TRANSFERS:
        raise ConfigurationError(
            f"SPARK_TORCH_RESULT_TRANSFER={value!r} is not valid; use 'auto' (the default), 'channel' or 'spark'"
        )
    return value


def _open_channel(attempt: Attempt, endpoint: ChannelEndpoint) -> DriverChannel:
    """Bind the run's channel, or say which address could not be bound and what to change."""
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
        )
    except OSError as exc:
        raise ConfigurationError(
            f"spark_torch could not listen for its channel on {endpoint.bind_host}"
            f"{f' (ports {endpoint.ports[0]}-{endpoint.ports[1]})' if endpoint.ports else ''}: {exc}. "
            "The address comes from spark.driver.bindAddress, else spark.driver.host, else "
            "SPARK_TORCH_LOG_HOST; it must be an address of this machine. Free or widen the port "
            "range (SPARK_TORCH_CHANNEL_PORTS / spark.torch.channel.ports) if one is set"
        ) from exc


def run_distributed(
    spark: Any, attempt: Attempt, endpoint: ChannelEndpoint, data: DataInput | None = None
) -> ResultBytes | None:
    """Run the barrier stage; return rank 0's pickled result (function mode) or None."""
    plan = attempt.spec.plan
    if plan.local_mode:  # pragma: no cover - guarded by the caller
        raise ConfigurationError("run_distributed called with a local-mode plan")
    transfer = _result_transfer()
    by_file = attempt.spec.payload is not None and transfer != "spark"
    check_slots(spark, plan.num_nodes)
    channel = _open_channel(attempt, endpoint)
    channel.reports = attempt.report_coordinator(answer=channel.answer_reports)
    try:
        spec = replace(attempt.spec, channel=channel.spec, result_transfer=transfer)
        if not by_file:
            return _run_stage(spark, spec, attempt, channel, data)
        # node 0 moves rank 0's result in here when it shares this host (or filesystem), or
        # streams it over the channel into a file here
        with NodeWorkdir(spec.run_id, 0, role="driver") as result_dir:
            channel.result_path = os.path.join(result_dir.path, STREAMED_RESULT_FILE)
            return _run_stage(spark, replace(spec, result_dir=result_dir.path), attempt, channel, data)
    finally:
        channel.close()


def _run_stage(
    spark: Any, spec: RunSpec, attempt: Attempt, channel: DriverChannel, data: DataInput | None
) -> ResultBytes | None:
    plan = spec.plan
    # one input partition per node: the node's share of the data, or one placeholder row
    source = (
        data.df.select(*data.columns).repartition(plan.num_nodes)
        if data is not None
        else spark.range(0, plan.num_nodes, 1, plan.num_nodes)
    )
    df = source.mapInArrow(functools.partial(run_barrier_task, spec), RESULT_SCHEMA, barrier=True)
    tag = attempt.tag
    box: dict[str, Any] = {}
    done = threading.Event()
    worker = threading.Thread(target=_collect, args=(df, spark, tag, box, done), name=tag, daemon=True)
    worker.start()
    channel.start_rendezvous_clock()

    def cancel(reason: str) -> None:
        channel.stop_nodes(reason)
        try:
            # the nodes give their ranks SIGTERM and a grace period; cancelling the Spark job
            # first would kill the Python workers, and with them the ranks, at once
            channel.wait_for_nodes(timeout=STOP_GRACE_SECONDS)
        finally:
            cancel_tagged_job(spark, tag)
            done.wait(CANCEL_WAIT_SECONDS)

    try:
        finished = done.wait(attempt.timeout)
    except BaseException:  # KeyboardInterrupt: stop every node, then re-raise
        cancel("cancelled on the driver")
        raise
    if not finished:
        cancel("timeout")
    if not finished and "table" not in box:  # (a job that completed right at the deadline succeeded)
        running = [
            RankFailure(rank=r, host="?", exc_type="still running", exc_message="stopped", last_lines=attempt.tail(r))
            for r in range(plan.world_size)
        ]
        raise RunTimeoutError(
            running,
            headline=f"the run exceeded timeout={attempt.run_timeout:g}s; the Spark job was cancelled and the "
            f"ranks of all {plan.num_nodes} node(s) were stopped",
        )
    if "error" in box:
        channel.stop_nodes("another node failed")  # the nodes Spark did not stop yet
        channel.wait_for_nodes(timeout=FAILURE_REPORTS_SECONDS)  # other failed nodes' reports
        assert spec.channel is not None
        error = _failure_from_spark_error(box["error"], spec.channel.secret, list(channel.failures.values()))
        raise error from (error.__cause__ or box["error"])
    channel.wait_for_nodes(timeout=10.0)  # drain the last log lines
    table = box["table"]
    nodes = table.column("node").to_pylist()
    seqs = table.column("seq").to_pylist()
    errors = {
        node: table.column("data")[i].as_py().decode("utf-8", errors="replace")
        for i, (node, seq) in enumerate(zip(nodes, seqs))
        if seq == CHANNEL_ERROR_SEQ
    }
    channel.connect_errors(errors)
    reported = {node for node, seq in zip(nodes, seqs) if seq == FINISHED_SEQ}
    if len(reported) < plan.num_nodes:
        if data is not None and not reported:
            raise ConfigurationError("the DataFrame is empty; there is nothing to train on")
        raise LaunchError(
            f"only {len(reported)} of {plan.num_nodes} Spark barrier tasks reported back; "
            "check the executor logs"
        )
    if spec.payload is None:
        return None
    return _assemble_result(table, nodes, seqs, spec.result_dir, channel)


def _assemble_result(
    table: Any, nodes: list[int], seqs: list[int], result_dir: str | None, channel: DriverChannel
) -> ResultBytes:
    """Rank 0's pickled result: from the file node 0 handed over or streamed over the channel,
    or joined from its Arrow rows."""
    data = table.column("data")
    kinds = (HANDED_OVER_SEQ, STREAMED_SEQ)
    rows = sorted((seq, i) for i, (node, seq) in enumerate(zip(nodes, seqs)) if node == 0 and (seq >= 0 or seq in kinds))
    if rows and rows[0][0] == STREAMED_SEQ:
        size = int(data[rows[0][1]].as_py().decode("ascii"))
        received = channel.result_size()
        if received != size or channel.result_path is None:
            raise LaunchError(f"rank 0's result: node 0 streamed {size} bytes over the channel, the driver has {received}")
        return map_file(channel.result_path)
    if rows and rows[0][0] == HANDED_OVER_SEQ:
        size = int(data[rows[0][1]].as_py().decode("ascii"))
        path = os.path.join(result_dir or "", RESULT_FILE)
        try:
            result = map_file(path)
        except OSError as exc:
            raise LaunchError(f"rank 0's result file {path} could not be read on the driver ({exc})") from exc
        if len(result) != size:
            raise LaunchError(
                f"rank 0's result file {path} has {len(result)} bytes on the driver, node 0 wrote {size}; "
                "is the driver's temp directory on a filesystem that does not show other hosts' writes at once?"
            )
        return result
    pieces = [data[i].as_buffer() for seq, i in rows if seq >= 0]  # zero-copy views of Arrow memory
    joined = bytearray(sum(p.size for p in pieces))
    view = memoryview(joined)
    offset = 0
    for piece in pieces:
        view[offset : offset + piece.size] = memoryview(piece).cast("B")
        offset += piece.size
    return joined
