"""Driver side of distributed mode: one Spark barrier stage, one task per node."""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from typing import Any

from .attempt import Attempt
from .channel import LogServer, new_secret
from .cluster import is_connect_session
from .dataframe import DataInput
from .entrypoint import Entrypoint, ScriptEntrypoint
from .errors import (
    ConfigurationError,
    DistributedRunError,
    InsufficientSlotsError,
    LaunchError,
    RankFailure,
    RunTimeoutError,
)
from .node import NodeWorkdir
from .plan import LaunchPlan
from .serialization import ResultBytes, map_file, rebuild_exception
from .task import FINISHED_SEQ, HANDED_OVER_SEQ, RESULT_FILE, RESULT_SCHEMA, TaskSpec, decode_failure, run_barrier_task

__all__ = ["run_distributed", "available_slots", "check_slots"]

logger = logging.getLogger(__name__)

#: how long to wait for executors to register before declaring too few slots (cluster masters;
#: cold executor JVMs were seen to take 20-40 s); SPARK_TORCH_EXECUTOR_WAIT overrides it
EXECUTOR_WAIT_SECONDS = 60.0
#: after cancelling the Spark job, how long to wait for the job thread to return
CANCEL_WAIT_SECONDS = 30.0


def client_log_host() -> str:
    """Address a Spark Connect client listens on for rank logs (executors must reach it).

    ``SPARK_TORCH_LOG_HOST`` wins, then ``SPARK_LOCAL_IP``, then this host's resolved name.
    """
    import socket

    return (
        os.environ.get("SPARK_TORCH_LOG_HOST")
        or os.environ.get("SPARK_LOCAL_IP")
        or socket.gethostbyname(socket.gethostname())
    )


def available_slots(spark: Any) -> int | None:
    """Task slots the cluster offers at once for the default resource profile (None: unknown)."""
    if is_connect_session(spark):
        return None
    jsc = spark.sparkContext._jsc.sc()
    profile = jsc.resourceProfileManager().defaultResourceProfile()
    return int(jsc.maxNumConcurrentTasks(profile))


def check_slots(spark: Any, needed: int) -> None:
    """Fail fast, instead of Spark's ~10 minute retry loop, when the barrier stage cannot fit."""
    slots = available_slots(spark)
    if slots is None or slots >= needed:
        return
    master = spark.sparkContext.master
    if not master.startswith("local["):
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


def _failure_from_spark_error(exc: BaseException) -> BaseException:
    """Turn a Spark job failure into the library's error, keeping the remote report."""
    text = str(exc)
    report = decode_failure(text)
    if report is not None:
        failures = [RankFailure.from_dict(f) for f in report.get("failures", [])]
        if len(failures) == 1 and failures[0].exc_type == "LaunchError":
            return LaunchError(failures[0].exc_message or "the ranks could not be started")
        if len(failures) == 1 and failures[0].exc_type == "ConfigurationError":
            return ConfigurationError(failures[0].exc_message or "invalid input")
        error = DistributedRunError(failures, report.get("headline"))
        pickled = report.get("pickled") or {}
        if error.failures:
            root = error.failures[0]
            cause = rebuild_exception(root, pickled.get(str(root.rank)))
            if cause is not None:
                error.__cause__ = cause
        return error
    for module in ("spark_torch", "pyarrow", "pandas", "cloudpickle"):
        if f"No module named '{module}'" in text:
            return LaunchError(
                f"the executors' Python cannot import {module}: install spark-torch (and pyarrow, "
                "pandas<3) on every executor, or point PYSPARK_PYTHON / spark.pyspark.python at an "
                "interpreter that has them"
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
        if not is_connect_session(spark):
            # cancelling must interrupt the task threads, so Spark kills the Python workers
            # (and with them the ranks) instead of waiting for the tasks to finish
            spark.sparkContext.setInterruptOnCancel(True)
        spark.addTag(tag)
        try:
            box["table"] = df.toArrow()
        finally:
            spark.removeTag(tag)
    except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
        box["error"] = exc
    finally:
        done.set()


def _result_by_file() -> bool:
    """``SPARK_TORCH_RESULT_TRANSFER``: ``auto`` (default: by file when node 0 can reach the
    driver's temp dir, else through Spark) or ``spark`` (always through Spark's result channel)."""
    value = os.environ.get("SPARK_TORCH_RESULT_TRANSFER", "auto").strip().lower()
    if value not in ("auto", "spark"):
        raise ConfigurationError(
            f"SPARK_TORCH_RESULT_TRANSFER={value!r} is not valid; use 'auto' (the default) or 'spark'"
        )
    return value == "auto"


def run_distributed(
    spark: Any,
    plan: LaunchPlan,
    entry: Entrypoint,
    payload: bytes | None,
    attempt: Attempt,
    driver_host: str,
    data: DataInput | None = None,
) -> ResultBytes | None:
    """Run the barrier stage; return rank 0's pickled result (function mode) or None."""
    if plan.local_mode:  # pragma: no cover - guarded by the caller
        raise ConfigurationError("run_distributed called with a local-mode plan")
    by_file = payload is not None and _result_by_file()
    check_slots(spark, plan.num_nodes)
    secret = new_secret()
    if is_connect_session(spark):
        # the driver runs in the Connect server; the log channel ends here, on the client
        driver_host = client_log_host()
    server = LogServer(driver_host, secret, attempt.on_lines)
    server.expect_nodes(plan.num_nodes)
    try:
        if not by_file:
            return _run_stage(spark, plan, entry, payload, attempt, server, secret, data, None)
        # node 0 moves rank 0's result in here when it shares this host (or filesystem)
        with NodeWorkdir(attempt.run_id, 0, role="driver") as result_dir:
            return _run_stage(spark, plan, entry, payload, attempt, server, secret, data, result_dir.path)
    finally:
        if server is not None:
            server.close()


def _run_stage(
    spark: Any,
    plan: LaunchPlan,
    entry: Entrypoint,
    payload: bytes | None,
    attempt: Attempt,
    server: LogServer | None,
    secret: bytes,
    data: DataInput | None,
    result_dir: str | None,
) -> ResultBytes | None:
    timeout = attempt.timeout
    spec = TaskSpec(
        run_id=attempt.run_id,
        restart_count=attempt.restart_count,
        max_restarts=attempt.max_restarts,
        num_nodes=plan.num_nodes,
        procs_per_node=plan.procs_per_node,
        payload=payload,
        script=entry.path if isinstance(entry, ScriptEntrypoint) else None,
        script_argv=entry.argv if isinstance(entry, ScriptEntrypoint) else (),
        extra_env=attempt.extra_env,
        threads_per_rank=plan.threads_per_rank,
        use_gpu=plan.use_gpu,
        driver_cwd=os.getcwd(),
        log_host=server.host if server else None,
        log_port=server.port if server else 0,
        log_secret=secret if server else b"",
        data_columns=data.columns if data else None,
        data_explicit=data.explicit if data else False,
        result_dir=result_dir,
    )
    # one input partition per node: the node's share of the data (round-robin, deterministic
    # for a given DataFrame), or one placeholder row
    source = (
        data.df.select(*data.columns).repartition(plan.num_nodes)
        if data is not None
        else spark.range(0, plan.num_nodes, 1, plan.num_nodes)
    )
    df = source.mapInArrow(
        functools.partial(run_barrier_task, spec), RESULT_SCHEMA, barrier=True
    )
    tag = attempt.tag
    box: dict[str, Any] = {}
    done = threading.Event()
    worker = threading.Thread(target=_collect, args=(df, spark, tag, box, done), name=tag, daemon=True)
    worker.start()

    def cancel(reason: str) -> None:
        if server is not None:
            server.stop_nodes(reason)
        spark.interruptTag(tag)
        done.wait(CANCEL_WAIT_SECONDS)

    try:
        finished = done.wait(timeout)
    except BaseException:  # KeyboardInterrupt: stop every node, then re-raise
        cancel("cancelled on the driver")
        raise
    if not finished:
        cancel("timeout")
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
        if server is not None:  # the nodes Spark did not stop yet
            server.stop_nodes("another node failed")
        error = _failure_from_spark_error(box["error"])
        raise error from (error.__cause__ or box["error"])
    if server is not None:
        server.wait_for_nodes(plan.num_nodes, timeout=10.0)  # drain the last log lines
    table = box["table"]
    nodes = table.column("node").to_pylist()
    seqs = table.column("seq").to_pylist()
    reported = {node for node, seq in zip(nodes, seqs) if seq == FINISHED_SEQ}
    if len(reported) < plan.num_nodes:
        if data is not None and not reported:
            raise ConfigurationError("the DataFrame is empty; there is nothing to train on")
        raise LaunchError(
            f"only {len(reported)} of {plan.num_nodes} Spark barrier tasks reported back; "
            "check the executor logs"
        )
    if payload is None:
        return None
    return _assemble_result(table, nodes, seqs, result_dir)


def _assemble_result(table: Any, nodes: list[int], seqs: list[int], result_dir: str | None) -> ResultBytes:
    """Rank 0's pickled result: from the file node 0 handed over, or joined from its Arrow rows."""
    data = table.column("data")
    rows = sorted((seq, i) for i, (node, seq) in enumerate(zip(nodes, seqs)) if node == 0 and seq != FINISHED_SEQ)
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
