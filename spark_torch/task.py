"""Executor side of distributed mode: the body of one Spark barrier task (one node).

It rendezvouses with the other tasks in ONE ``allGather`` round (node 0 publishes the port it
reserved), runs the node's ranks, and returns rank 0's pickled result through Spark's own
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
from .errors import RankFailure
from .channel import LogClient
from .node import NodeSpec, run_node
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
    #: the driver's log channel; the secret is never printed (repr=False)
    log_host: str | None = None
    log_port: int = 0
    log_secret: bytes = field(default=b"", repr=False)


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


def _print_to_executor_log(host: str) -> Any:
    def on_line(rank: int, stream: str, text: str) -> None:
        sys.stderr.write(f"[rank {rank}] {text}\n")
        sys.stderr.flush()

    return on_line


def run_barrier_task(spec: TaskSpec, batches: Iterator[Any]) -> Iterator[Any]:
    """``mapInArrow`` body: one node of the run."""
    import pyarrow as pa
    from pyspark import BarrierTaskContext

    for _ in batches:  # the input rows only shape the stage; one per node
        pass
    context = BarrierTaskContext.get()
    node_rank = context.partitionId()
    infos = context.getTaskInfos()
    master_host = infos[0].address.rsplit(":", 1)[0]
    host = infos[node_rank].address.rsplit(":", 1)[0] or socket.gethostname()
    reservation = reserve_port(master_host) if node_rank == 0 else None
    try:
        port = reservation.getsockname()[1] if reservation is not None else 0
        here = {"node": node_rank, "port": port, "python": platform.python_version()}
        messages = [json.loads(m) for m in context.allGather(json.dumps(here))]
        master_port = int(messages[0]["port"])
        mismatched = sorted({m["python"] for m in messages} | {spec.driver_python})
        if len(mismatched) > 1:
            failure = RankFailure(
                rank=node_rank * spec.procs_per_node,
                host=host,
                exc_type="LaunchError",
                exc_message=f"Python versions differ between the driver and executors ({', '.join(mismatched)}); "
                "set PYSPARK_PYTHON (or spark.pyspark.python) to the same interpreter everywhere",
            )
            raise NodeFailed(encode_failure([failure], {}))
        if spec.script is not None and not os.path.isfile(spec.script):
            failure = RankFailure(
                rank=node_rank * spec.procs_per_node,
                host=host,
                exc_type="LaunchError",
                exc_message=f"training script {spec.script} does not exist on executor host {host}; "
                "in distributed mode the script must be at the same path on every executor "
                "(a shared filesystem, or ship it with spark.files / --files)",
            )
            raise NodeFailed(encode_failure([failure], {}))
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
            extra_env=spec.extra_env,
            threads_per_rank=spec.threads_per_rank,
            visible_devices=visible,
            host=host,
            restart_count=spec.restart_count,
            max_restarts=spec.max_restarts,
            cwd=spec.driver_cwd if spec.driver_cwd and os.path.isdir(spec.driver_cwd) else None,
        )
        stop = threading.Event()
        client = (
            LogClient(spec.log_host, spec.log_port, spec.log_secret, node_rank, on_stop=lambda _why: stop.set())
            if spec.log_host
            else None
        )
        try:
            outcome, pickled = run_node(node, client or _print_to_executor_log(host), stop=stop)
        finally:
            if client is not None:
                client.close()
    finally:
        if reservation is not None:
            reservation.close()
    if outcome.stopped:
        return  # the driver asked us to stop (timeout, Ctrl-C, another node failed)
    if outcome.failures:
        root = outcome.failures[0]
        raise NodeFailed(
            f"rank {root.rank} on {host} failed: {root.cause()} "
            f"(report for the driver follows)\n{encode_failure(outcome.failures, pickled)}"
        )
    seq = 0
    if outcome.result is not None:
        for seq, chunk in enumerate(serialization.chunks(outcome.result)):
            yield pa.RecordBatch.from_pydict(
                {"node": [node_rank], "seq": [seq], "data": [chunk]},
                schema=pa.schema([("node", pa.int32()), ("seq", pa.int32()), ("data", pa.binary())]),
            )
