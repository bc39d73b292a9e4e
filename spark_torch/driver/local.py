"""Local mode: every rank on the driver machine, started by the node runner in this process."""

from __future__ import annotations

import threading

from spark_torch.driver.attempt import Attempt
from spark_torch.driver.compat import collect_arrow
from spark_torch.driver.dataframe import DataInput, check_shards, data_env, write_node_data
from spark_torch.envelopes import ResultBytes, map_file, rebuild_exception
from spark_torch.errors import ConfigurationError, DistributedRunError, RunTimeoutError
from spark_torch.node.gpus import visible_devices
from spark_torch.node.processes import reserve_port
from spark_torch.node.runner import NodeSpec, NodeWorkdir, resume_env, run_node, start_store_host
from spark_torch.reporting.pipes import NodeReports

__all__ = ["run_local"]

LOCAL_HOST = "127.0.0.1"


def run_local(attempt: Attempt, data: DataInput | None = None) -> ResultBytes | None:
    """Run all ranks here; return rank 0's pickled result (function mode) or None."""
    spec = attempt.spec
    with NodeWorkdir(spec.run_id, 0) as workdir:
        node_env: dict[str, str] = {}
        if data is not None:
            # local mode: the driver reads the DataFrame and the ranks split its rows
            batches = collect_arrow(data.df.select(*data.columns)).to_batches()
            path, rows = write_node_data(batches, workdir.path)
            problem = check_shards([rows], spec.plan.procs_per_node)
            if problem:
                raise ConfigurationError(problem)
            node_env.update(data_env(path, data.columns, data.explicit, rows_per_node=[rows]))
        node_env.update(resume_env(spec, workdir.path))
        return _run_here(attempt, workdir, node_env)


def _run_here(attempt: Attempt, workdir: NodeWorkdir, node_env: dict[str, str]) -> ResultBytes | None:
    spec = attempt.spec
    reservation = reserve_port(LOCAL_HOST)
    store = start_store_host(spec, reservation.getsockname()[1], spec.cwd)
    timeout = attempt.timeout
    stop = threading.Event()
    timer = threading.Timer(timeout, stop.set) if timeout else None
    # report(): the node runner is on the driver, so its reports go straight to the coordinator
    reports = NodeReports(0, forward=lambda report: coordinator.node_report(0, report))
    coordinator = attempt.report_coordinator(answer=reports.persisted)
    try:
        node = NodeSpec(
            run=spec,
            node_rank=0,
            master_addr=LOCAL_HOST,
            master_port=reservation.getsockname()[1],
            # without GPUs the ranks see none (as with TorchDistributor), not whatever was inherited
            visible_devices=visible_devices(spec.plan.local_gpus) if spec.plan.use_gpu else "",
            node_env=node_env,
            cwd=spec.cwd,
            agent_store=store is not None,
        )
        if timer is not None:
            timer.daemon = True
            timer.start()
        outcome, pickled = run_node(node, attempt.on_lines, stop=stop if timer else None, workdir=workdir, reports=reports)
    finally:
        if timer is not None:
            timer.cancel()
        reports.close()
        if store is not None:
            store.close()
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
