"""One ``run()`` on the driver, start to end: plan, payload, settings, storage, then the
attempts (restarting the gang up to ``max_restarts`` times), and rank 0's value."""

from __future__ import annotations

import logging
import math
import os
import platform
import time
import uuid
from dataclasses import replace
from typing import Any

from spark_torch.driver.attempt import Attempt
from spark_torch.driver.cluster import ClusterInfo, read_cluster
from spark_torch.driver.config import DistributorConfig
from spark_torch.driver.dataframe import DataInput
from spark_torch.driver.elastic import GrowRestart, Membership
from spark_torch.driver.endpoints import ChannelEndpoint, resolve_endpoint
from spark_torch.driver.entrypoint import Entrypoint, FunctionEntrypoint, ScriptEntrypoint
from spark_torch.driver.logs import DriverLogSink
from spark_torch.driver.payload import dump_function_payload
from spark_torch.driver.plan import host_facts, make_plan
from spark_torch.driver.preflight import check_executors
from spark_torch.driver.progress import RunStatus, interactive
from spark_torch.driver.result import RunResult
from spark_torch.driver.tracker import ReportTracker
from spark_torch.envelopes import ResultBytes
from spark_torch.errors import ConfigurationError, DistributedRunError, RunTimeoutError
from spark_torch.reporting.storage import DEFAULT_STORAGE, RunStorage, storage_error
from spark_torch.settings import resolve as resolve_settings
from spark_torch.spec import DataSpec, RunSpec, StorageSpec
from spark_torch.version import package_identity

__all__ = ["execute", "new_run_id"]

logger = logging.getLogger(__name__)


def new_run_id() -> str:
    """A fresh run id (12 hex digits)."""
    return uuid.uuid4().hex[:12]


def execute(config: DistributorConfig, spark: Any, entry: Entrypoint, data: DataInput | None, outcome: RunResult) -> Any:
    """Run ``entry`` (see :meth:`Distributor.run`); fills ``outcome`` as it goes."""
    cluster = read_cluster(spark) if spark is not None else ClusterInfo()
    host = host_facts(config, cluster, os.environ)
    plan = make_plan(config, cluster, host=host)
    if plan.use_gpu and host.gpus_found and config.use_gpu is None:
        logger.info(
            "spark_torch: local mode on %d GPU(s) of this machine found by %s (%s); pass use_gpu=False to train on CPU",
            len(plan.local_gpus), host.gpus_found_by, ",".join(plan.local_gpus),
        )
    if plan.gpu_note:
        logger.warning(plan.gpu_note)
    if (cluster.ssl_enabled or cluster.crypto_enabled) and not plan.local_mode:
        logger.warning(
            "spark_torch: Spark encrypts its own traffic (%s); spark_torch's channel (logs, reports, results) "
            "is encrypted too, but torch's gloo/NCCL traffic between ranks is NOT encrypted",
            "spark.ssl.enabled" if cluster.ssl_enabled else "spark.network.crypto.enabled",
        )
    payload = dump_function_payload(entry) if isinstance(entry, FunctionEntrypoint) else None
    settings = resolve_settings(config.given_settings(), os.environ, cluster.torch_conf)
    endpoint = None if plan.local_mode else resolve_endpoint(cluster, settings)
    run_id = outcome.run_id
    token = uuid.uuid4().hex
    sink = DriverLogSink(config, plan.world_size)  # raises before anything is created for a bad log_dir
    try:
        storage = _storage(config, run_id, token)
    except BaseException:
        sink.close()
        raise
    base = RunSpec(
        plan=plan,
        run_id=run_id,
        max_restarts=config.max_restarts,
        payload=payload,
        script=entry.path if isinstance(entry, ScriptEntrypoint) else None,
        script_argv=entry.argv if isinstance(entry, ScriptEntrypoint) else (),
        files=dict(entry.files) if isinstance(entry, ScriptEntrypoint) else {},
        extra_env=config.env,
        cwd=os.getcwd(),
        driver_python=platform.python_version(),
        driver_package=package_identity(),
        data=DataSpec(columns=data.columns, explicit=data.explicit) if data is not None else None,
        storage=StorageSpec(base=storage.base, token=token, options=storage.options, required=config.storage_path is not None) if storage is not None else None,
        settings=settings,
    )
    deadline = time.monotonic() + config.timeout if config.timeout else None
    tracker = ReportTracker(outcome, sink, config, plan, run_id)
    membership = None
    if not plan.local_mode:
        minimum = config.min_processes or config.num_processes
        membership = Membership(
            max_nodes=plan.num_nodes,
            min_nodes=max(1, math.ceil(minimum / plan.procs_per_node)),
            procs_per_node=plan.procs_per_node,
            elastic_wait=settings.elastic_wait,
            executor_wait=settings.executor_wait,
        )
    try:
        show = interactive() if config.progress is None else config.progress
        unlimited = config.max_restarts < 0
        restart = failures = 0
        why = "start"
        while True:
            latest = storage.latest() if storage is not None else None
            resume = latest.step if latest is not None else 0
            if storage is not None:
                storage.discard_incomplete_after(resume)
            tracker.resume_from(resume)  # steps after the checkpoint will be reported again
            sized = plan
            if membership is not None and spark is not None:
                nodes, size_note = membership.nodes_for(spark, first=restart == 0)
                check_executors(spark, nodes, settings.ship_package)  # their Python, before the barrier stage
                sized = replace(plan, num_nodes=nodes)
                why = f"{why}: {size_note}"
            outcome.attempts.append({"attempt": restart, "world_size": sized.world_size, "nodes": sized.num_nodes, "reason": why})
            sink.status.close()
            sink.status = RunStatus(sized.world_size, enabled=show)
            attempt = Attempt(
                spec=replace(
                    base, plan=sized, restart_count=restart, resume_step=resume,
                    resume_url=latest.url if latest else None,
                ),  # fmt: skip
                timeout=None if deadline is None else max(0.001, deadline - time.monotonic()),
                run_timeout=config.timeout,
                on_lines=sink,
                tail=sink.tail,
                on_row=tracker.row,
                keep_checkpoints=config.keep_checkpoints,
                score_attribute=config.checkpoint_score_attribute,
                score_order=config.checkpoint_score_order,
                membership=membership if config.elastic_grow else None,
            )
            outcome.restarts = restart
            try:
                result = _run_attempt(spark, attempt, endpoint, data)
                break
            except GrowRestart as exc:  # not a failure: does not count against max_restarts
                restart += 1
                why = f"grow ({exc})"
            except RunTimeoutError:
                raise
            except DistributedRunError as exc:
                if not unlimited and failures >= config.max_restarts:
                    raise
                restart += 1
                failures += 1
                cause = str(exc).splitlines()[0]
                why = f"restart after a failure ({cause[:200]})"
                logger.warning(
                    "spark_torch: run %s failed (%s); restarting the gang (%d of %s)",
                    run_id, cause, failures, "unlimited" if unlimited else config.max_restarts,
                )
        outcome.value = _unpickle_result(result)
        return outcome.value
    except BaseException as exc:
        outcome.error = exc
        raise
    finally:
        try:
            outcome.collect(storage, config.checkpoint_score_attribute, config.checkpoint_score_order)
        except Exception as exc:  # noqa: BLE001 - the run's own outcome or error matters more
            logger.warning("spark_torch: the run's history and checkpoints could not be read back: %s", storage_error(str(storage and storage.url), exc))
        tracker.close()
        sink.status.close()
        sink.close()
        if storage is not None and config.run_id is None and config.storage_path is None:
            storage.remove_if_unused()  # a run that reported nothing leaves no empty directory

def _storage(config: DistributorConfig, run_id: str, token: str) -> RunStorage | None:
    """The run's storage, created and marked now; without an explicit ``storage_path`` a
    default that cannot be created only disables checkpoints (with a warning). Whatever an fsspec
    backend raises becomes one ConfigurationError naming the URL."""
    storage = RunStorage(config.storage_path or DEFAULT_STORAGE, run_id, config.storage_options)
    try:
        storage.create(token)
    except Exception as exc:  # noqa: BLE001 - every backend raises its own kinds (TypeError, botocore's...)
        if config.storage_path is not None:
            raise ConfigurationError(f"storage_path={config.storage_path!r}: cannot create the run's directory; {storage_error(storage.url, exc)}") from exc
        logger.warning(
            "spark_torch: checkpoints are disabled: the default storage %s cannot be created (%s); "
            "pass storage_path= to use report(checkpoint=...)", storage.url, exc,
        )
        return None
    return storage


def _run_attempt(spark: Any, attempt: Attempt, endpoint: ChannelEndpoint | None, data: DataInput | None) -> ResultBytes | None:
    if endpoint is None:
        from spark_torch.driver.local import run_local

        return run_local(attempt, data)
    from spark_torch.driver.barrier import run_distributed

    return run_distributed(spark, attempt, endpoint, data)


def _unpickle_result(result: ResultBytes | None) -> Any:
    """Rank 0's value; the bytes came from this run's own file or Spark's result channel."""
    if result is None:
        return None
    import cloudpickle

    try:
        return cloudpickle.loads(result)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure gets the same advice
        raise DistributedRunError(
            [],
            headline=f"rank 0 returned a result that cannot be unpickled on the driver "
            f"({type(exc).__name__}: {exc}); return plain data (numbers, lists, dicts, tensors, "
            "state_dict()) or make the classes it uses importable on the driver",
        ) from exc
    finally:
        close = getattr(result, "close", None)  # a memory map of the result file
        if close is not None:
            close()
