"""Local mode: every rank on the driver machine, started by the node runner in this process."""

from __future__ import annotations

import os
import threading

from .attempt import Attempt
from .dataframe import DataInput, check_shards, data_env, write_node_data
from .entrypoint import Entrypoint, ScriptEntrypoint
from .errors import ConfigurationError, DistributedRunError, RunTimeoutError
from .gpus import visible_devices
from .node import NodeSpec, NodeWorkdir, run_node
from .plan import LaunchPlan
from .processes import reserve_port
from .serialization import ResultBytes, map_file, rebuild_exception

__all__ = ["run_local"]

LOCAL_HOST = "127.0.0.1"


def run_local(
    plan: LaunchPlan,
    entry: Entrypoint,
    payload: bytes | None,
    attempt: Attempt,
    data: DataInput | None = None,
) -> ResultBytes | None:
    """Run all ranks here; return rank 0's pickled result (function mode) or None."""
    with NodeWorkdir(attempt.run_id, 0) as workdir:
        extra_env = dict(attempt.extra_env)
        if data is not None:
            # local mode: the driver reads the DataFrame and the ranks split its rows
            batches = data.df.select(*data.columns).toArrow().to_batches()
            path, rows = write_node_data(batches, workdir.path)
            problem = check_shards([rows], plan.procs_per_node)
            if problem:
                raise ConfigurationError(problem)
            extra_env.update(data_env(path, data.columns, data.explicit))
        return _run_here(plan, entry, payload, attempt, workdir, extra_env)


def _run_here(
    plan: LaunchPlan,
    entry: Entrypoint,
    payload: bytes | None,
    attempt: Attempt,
    workdir: NodeWorkdir,
    extra_env: dict[str, str],
) -> ResultBytes | None:
    reservation = reserve_port(LOCAL_HOST)
    timeout = attempt.timeout
    stop = threading.Event()
    timer = threading.Timer(timeout, stop.set) if timeout else None
    try:
        spec = NodeSpec(
            run_id=attempt.run_id,
            restart_count=attempt.restart_count,
            max_restarts=attempt.max_restarts,
            node_rank=0,
            num_nodes=1,
            procs_per_node=plan.procs_per_node,
            master_addr=LOCAL_HOST,
            master_port=reservation.getsockname()[1],
            payload=payload,
            script=entry.path if isinstance(entry, ScriptEntrypoint) else None,
            script_argv=entry.argv if isinstance(entry, ScriptEntrypoint) else (),
            extra_env=extra_env,
            threads_per_rank=plan.threads_per_rank,
            visible_devices=visible_devices(plan.local_gpus) if plan.use_gpu else None,
            cwd=os.getcwd(),
        )
        if timer is not None:
            timer.daemon = True
            timer.start()
        outcome, pickled = run_node(spec, attempt.on_lines, stop=stop if timer else None, workdir=workdir)
    finally:
        if timer is not None:
            timer.cancel()
        reservation.close()
    if outcome.stopped:
        raise RunTimeoutError(
            outcome.running_at_stop,
            headline=f"the run exceeded timeout={attempt.run_timeout:g}s; ranks "
            f"{', '.join(str(f.rank) for f in outcome.running_at_stop) or '(none)'} were still "
            "running and have been stopped",
        )
    if outcome.failures:
        error = DistributedRunError(outcome.failures)
        root = error.failures[0]
        cause = rebuild_exception(root, pickled.get(root.rank))
        if cause is not None:
            raise error from cause
        raise error
    if outcome.result_file is None:
        return None
    return map_file(outcome.result_file)  # stays readable after the workdir is removed
