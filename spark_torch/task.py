"""Executor side of distributed mode: the body of one Spark barrier task (one node).

It rendezvouses with the other tasks through the driver's log/control channel (each node says
hello; node 0's hello carries the port it reserved; a Spark ``allGather`` round, about a second,
is only the fallback without a channel), runs the node's ranks, and returns rank 0's pickled result through Spark's own
result channel as Arrow rows. A failure is raised as a task exception carrying a JSON report
between markers: Spark then aborts the barrier stage at once (a barrier result stage is never
retried), kills the other tasks (their ranks die with their worker) and hands the report to
the driver. Imports no driver-side module.
"""

from __future__ import annotations

import base64
import json
import os
import platform
import socket
import sys
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from . import serialization
from .channel import LogClient
from .dataframe import check_shards, data_env, write_node_data
from .errors import RankFailure
from .node import NodeSpec, NodeWorkdir, run_node
from .processes import reserve_port

__all__ = ["TaskSpec", "run_barrier_task", "RESULT_SCHEMA", "FAILURE_MARKER", "encode_failure", "decode_failure"]

RESULT_SCHEMA = "node int, seq int, data binary"
FAILURE_MARKER = "SPARK_TORCH_FAILURE"
#: bound on what a failure report carries through Spark's exception message
MAX_PICKLED_EXCEPTION = 64 * 1024


@dataclass(frozen=True)
class TaskSpec:
    """What every barrier task needs; resolved on the driver, only read here."""

    run_id: str
    num_nodes: int
    procs_per_node: int
    payload: bytes | None
    script: str | None
    script_argv: tuple[str, ...]
    extra_env: Mapping[str, str] = field(default_factory=dict)
    threads_per_rank: int = 1
    use_gpu: bool = False
    driver_python: str = platform.python_version()
    driver_cwd: str | None = None
    restart_count: int = 0
    max_restarts: int = 0
    #: run_on_dataframe: the columns arriving as the task's input rows (None: no data)
    data_columns: tuple[str, ...] | None = None
    data_explicit: bool = False
    #: the driver's log channel; the secret is never printed (repr=False)
    log_host: str | None = None
    log_port: int = 0
    log_secret: bytes = field(default=b"", repr=False)
    #: a directory the driver made for rank 0's result: used when node 0 can write it (same
    #: host or a shared filesystem), else the result travels as Arrow rows
    result_dir: str | None = None


def encode_failure(failures: list[RankFailure], pickled: dict[int, str | None], headline: str | None = None) -> str:
    """A one-line, marker-delimited report that survives Spark's exception text."""
    report: dict[str, Any] = {"failures": [f.to_dict() for f in failures], "headline": headline}
    small = {str(r): p for r, p in pickled.items() if p and len(p) <= MAX_PICKLED_EXCEPTION}
    report["pickled"] = small
    blob = base64.b64encode(json.dumps(report).encode("utf-8")).decode("ascii")
    return f"{FAILURE_MARKER}<{blob}>{FAILURE_MARKER}"


def decode_failure(text: str) -> dict[str, Any] | None:
    """Find and decode the report in a Spark exception's text (the first one wins)."""
    start = text.find(FAILURE_MARKER + "<")
    if start < 0:
        return None
    start += len(FAILURE_MARKER) + 1
    end = text.find(">" + FAILURE_MARKER, start)
    if end < 0:
        return None
    try:
        data = json.loads(base64.b64decode(text[start:end]).decode("utf-8"))
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


class NodeFailed(RuntimeError):
    """Raised in the task so that Spark aborts the barrier stage; carries the encoded report."""


def _print_to_executor_log(rank: int, stream: str, block: str) -> None:
    """Without a driver channel, rank output goes to the executor's stderr log."""
    prefix = f"[rank {rank}] "
    sys.stderr.write(prefix + block.replace("\n", "\n" + prefix) + "\n")
    sys.stderr.flush()


def run_barrier_task(spec: TaskSpec, batches: Iterator[Any]) -> Iterator[Any]:
    """``mapInArrow`` body: one node of the run."""
    from pyspark import BarrierTaskContext

    context = BarrierTaskContext.get()
    node_rank = context.partitionId()
    with NodeWorkdir(spec.run_id, node_rank) as workdir:
        outcome = _run_node_task(spec, context, batches, workdir)
        if outcome is None:
            return  # the driver asked us to stop (timeout, Ctrl-C, another node failed)
        # seq -1: "this node finished"; the driver checks that every node did
        yield _row(node_rank, FINISHED_SEQ, b"")
        if outcome.result_file is not None:
            yield from _result_rows(node_rank, outcome.result_file, spec.result_dir)


#: row kinds besides the result's chunks (seq >= 0)
FINISHED_SEQ = -1
HANDED_OVER_SEQ = -2  # the result is in the driver's result_dir; data = its size in ASCII
RESULT_FILE = "rank-0.result"


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
                serialization.write_atomic_from(target, src)
        return size
    except OSError:
        return None


def _result_rows(node_rank: int, result_file: str, result_dir: str | None) -> Iterator[Any]:
    """Rank 0's result: by file when the driver can see it, else as 16 MiB Arrow rows."""
    size = _hand_over(result_file, result_dir)
    if size is not None:
        yield _row(node_rank, HANDED_OVER_SEQ, str(size).encode("ascii"))
        return
    with open(result_file, "rb") as fh:
        seq = 0
        while True:
            piece = fh.read(serialization.CHUNK_SIZE)
            if not piece and seq > 0:
                break
            yield _row(node_rank, seq, piece)
            seq += 1
            if len(piece) < serialization.CHUNK_SIZE:
                break


def _launch_error(rank: int, host: str, message: str, kind: str = "LaunchError") -> NodeFailed:
    failure = RankFailure(rank=rank, host=host, exc_type=kind, exc_message=message)
    return NodeFailed(f"{message}\n{encode_failure([failure], {})}")


def _run_node_task(spec: TaskSpec, context: Any, batches: Iterator[Any], workdir: NodeWorkdir) -> Any:
    """Stage data, rendezvous once, run the ranks; returns the outcome, or None when stopped."""
    node_rank = context.partitionId()
    infos = context.getTaskInfos()
    master_host = infos[0].address.rsplit(":", 1)[0]
    host = infos[node_rank].address.rsplit(":", 1)[0] or socket.gethostname()
    extra_env = dict(spec.extra_env)
    rows = 0
    if spec.data_columns is not None:
        path, rows = write_node_data(batches, workdir.path)
        extra_env.update(data_env(path, spec.data_columns, spec.data_explicit))
    else:
        for _ in batches:  # the input rows only shape the stage; one per node
            pass
    first_rank = node_rank * spec.procs_per_node
    stop = threading.Event()
    client = (
        LogClient(spec.log_host, spec.log_port, spec.log_secret, node_rank, on_stop=lambda _why: stop.set())
        if spec.log_host
        else None
    )
    reservation = reserve_port(master_host) if node_rank == 0 else None
    try:
        port = reservation.getsockname()[1] if reservation is not None else 0
        here = {"node": node_rank, "port": port, "python": platform.python_version(), "rows": rows}
        if client is not None:
            # the rendezvous goes through the driver's authenticated channel (milliseconds);
            # a Spark allGather round costs about a second
            peers = client.rendezvous(here, stop)
            if peers is None:
                return None  # the driver stopped the run before every node said hello
            messages = peers
        else:
            messages = [json.loads(m) for m in context.allGather(json.dumps(here))]
        master_port = int(messages[0]["port"])
        versions = sorted({m["python"] for m in messages} | {spec.driver_python})
        if len(versions) > 1:
            raise _launch_error(
                first_rank, host,
                f"Python versions differ between the driver and executors ({', '.join(versions)}); "
                "set PYSPARK_PYTHON (or spark.pyspark.python) to the same interpreter everywhere",
            )
        if spec.data_columns is not None:
            problem = check_shards([int(m["rows"]) for m in messages], spec.procs_per_node)
            if problem:
                raise _launch_error(first_rank, host, problem, kind="ConfigurationError")
        if spec.script is not None and not os.path.isfile(spec.script):
            raise _launch_error(
                first_rank, host,
                f"training script {spec.script} does not exist on executor host {host}; "
                "in distributed mode the script must be at the same path on every executor "
                "(a shared filesystem, or ship it with spark.files / --files)",
            )
        visible = None
        if spec.use_gpu:
            addresses = list(context.resources()["gpu"].addresses)
            visible = ",".join(addresses[: spec.procs_per_node])
        node = NodeSpec(
            run_id=spec.run_id,
            node_rank=node_rank,
            num_nodes=spec.num_nodes,
            procs_per_node=spec.procs_per_node,
            master_addr=master_host,
            master_port=master_port,
            payload=spec.payload,
            script=spec.script,
            script_argv=spec.script_argv,
            extra_env=extra_env,
            threads_per_rank=spec.threads_per_rank,
            visible_devices=visible,
            host=host,
            restart_count=spec.restart_count,
            max_restarts=spec.max_restarts,
            cwd=spec.driver_cwd if spec.driver_cwd and os.path.isdir(spec.driver_cwd) else None,
        )
        outcome, pickled = run_node(node, client or _print_to_executor_log, stop=stop, workdir=workdir)
    finally:
        if client is not None:
            client.close()
        if reservation is not None:
            reservation.close()
    if outcome.stopped:
        return None
    if outcome.failures:
        root = outcome.failures[0]
        raise NodeFailed(
            f"rank {root.rank} on {host} failed: {root.cause()} "
            f"(report for the driver follows)\n{encode_failure(outcome.failures, pickled)}"
        )
    return outcome
