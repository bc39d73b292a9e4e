"""The public facade: :class:`Distributor`."""

from __future__ import annotations

import logging
import os
import platform
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from spark_torch.driver.attempt import Attempt
from spark_torch.driver.cluster import IGNORE_SSL_KEY, ClusterInfo, read_cluster
from spark_torch.driver.config import DistributorConfig
from spark_torch.driver.endpoints import ChannelEndpoint, resolve_endpoint
from spark_torch.driver.entrypoint import FunctionEntrypoint, ScriptEntrypoint, make_entrypoint
from spark_torch.driver.logs import DriverLogSink
from spark_torch.driver.plan import HostFacts, make_plan
from spark_torch.driver.progress import RunStatus, interactive
from spark_torch.driver.result import RunResult
from spark_torch.driver.tracker import ReportTracker
from spark_torch.errors import ConfigurationError
from spark_torch.node.gpus import detect_local_gpus
from spark_torch.reporting.storage import DEFAULT_STORAGE, RunStorage
from spark_torch.settings import resolve as resolve_settings
from spark_torch.spec import DataSpec, LaunchPlan, RunSpec

if TYPE_CHECKING:
    from spark_torch.envelopes import ResultBytes

__all__ = ["Distributor"]

logger = logging.getLogger(__name__)


class Distributor:
    """Run a PyTorch distributed program on Spark: on the driver, or on Spark barrier tasks.

    A drop-in replacement for ``pyspark.ml.torch.distributor.TorchDistributor``::

        from spark_torch import Distributor

        def train(lr, batch_size=32):
            import torch.distributed as dist
            dist.init_process_group("gloo")  # env:// — RANK, WORLD_SIZE, MASTER_* are set
            ...
            return metrics  # rank 0's return value comes back

        metrics = Distributor(num_processes=2, local_mode=False).run(train, 1e-3, batch_size=64)
        Distributor(num_processes=4, local_mode=False).run("repo/train.py", "--lr=0.001")

    Args:
        num_processes: total number of ranks (``WORLD_SIZE``), an int >= 1.
        local_mode: True runs every rank on the driver machine; False runs one Spark barrier
            task per node on the executors (one rank per task on CPU, one rank per GPU of a
            task with GPUs).
        use_gpu: True/False, or None to use GPUs when Spark gives this run GPUs
            (``spark.task.resource.gpu.amount`` in distributed mode,
            ``spark.driver.resource.gpu.amount`` in local mode).
        spark: the SparkSession to use; default the active one, else an embedded ``local[*]``
            session is started (distributed mode only: local mode does not need Spark).
        env: extra environment variables for every rank (e.g. ``NCCL_SOCKET_IFNAME``).
        timeout: bound on the whole run in seconds; on expiry every rank is stopped and
            :class:`~spark_torch.RunTimeoutError` is raised.
        log_ranks: whose output the driver prints: ``"all"`` (default, also ``None``) or a
            list of ranks such as ``[0]``.
        log_dir: also write each rank's output to ``log_dir/rank-N.log``.
        max_restarts: restart the whole gang up to this many times when a rank fails.
        ranks_per_task: distributed CPU mode: ranks per barrier task (node), default 1; set
            ``spark.task.cpus`` to the cores they share. With GPUs it is the task's GPU count.
        progress: show a live status line (ranks started/running/finished/failed, elapsed, the
            latest reported metrics) that ends as one summary line; None shows it only in a
            terminal or Jupyter (where a chart of the reported metrics is drawn too).
        storage_path: where :func:`spark_torch.report` persists checkpoints and metrics: a
            directory or an fsspec URL (``s3://...``); default ``~/spark_torch_runs``. Runs
            whose ranks are on several hosts need storage every host can reach.
        run_id: the run's name under ``storage_path``; giving an existing one resumes from its
            latest checkpoint (default: a fresh id, see ``last_run.run_id``).
        keep_checkpoints: keep only this many newest checkpoints (default: all).
        mlflow: log the reported metrics, parameters and the final checkpoint to one MLflow
            run (None: when an MLflow run is active on the driver).
    """

    def __init__(
        self,
        num_processes: int = 1,
        local_mode: bool = True,
        use_gpu: bool | None = None,
        *,
        spark: Any | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float | None = None,
        log_ranks: Any = "all",
        log_dir: str | None = None,
        max_restarts: int = 0,
        ranks_per_task: int | None = None,
        progress: bool | None = None,
        storage_path: str | os.PathLike[str] | None = None,
        run_id: str | None = None,
        keep_checkpoints: int | None = None,
        mlflow: bool | None = None,
        channel_host: str | None = None,
        channel_bind_address: str | None = None,
        channel_ports: str | tuple[int, int] | None = None,
        rendezvous_timeout: float | None = None,
        heartbeat: float | None = None,
        result_transfer: str | None = None,
        executor_wait: float | None = None,
        warm_start: bool | None = None,
    ) -> None:
        self.config = DistributorConfig(
            num_processes=num_processes,
            local_mode=local_mode,
            use_gpu=use_gpu,
            env=dict(env or {}),
            timeout=timeout,
            log_ranks=log_ranks,
            log_dir=log_dir,
            max_restarts=max_restarts,
            ranks_per_task=ranks_per_task,
            progress=progress,
            storage_path=os.fspath(storage_path) if storage_path is not None else None,
            run_id=run_id,
            keep_checkpoints=keep_checkpoints,
            mlflow=mlflow,
            channel_host=channel_host,
            channel_bind_address=channel_bind_address,
            channel_ports=channel_ports,
            rendezvous_timeout=rendezvous_timeout,
            heartbeat=heartbeat,
            result_transfer=result_transfer,
            executor_wait=executor_wait,
            warm_start=warm_start,
        )
        self._spark = spark
        #: the outcome of the latest run() (value, metrics, checkpoint, restarts, error)
        self.last_run: RunResult | None = None

    @property
    def num_processes(self) -> int:
        """Total number of ranks."""
        return self.config.num_processes

    @property
    def local_mode(self) -> bool:
        """Whether ranks run on the driver machine."""
        return self.config.local_mode

    def _session(self) -> Any | None:
        if self._spark is not None:
            return self._spark
        from spark_torch.driver.session import active_session, get_or_create_session

        return active_session() if self.config.local_mode else get_or_create_session()

    def _host_facts(self, cluster: ClusterInfo) -> HostFacts:
        """The driver machine's own facts; its GPUs are looked for only when local mode may use them."""
        found: tuple[tuple[str, ...], str] = ((), "")
        spark_gives_gpus = cluster.driver_gpu_amount > 0 and bool(cluster.driver_gpu_addresses)
        if self.config.local_mode and self.config.use_gpu is not False and not spark_gives_gpus:
            found = detect_local_gpus(os.environ)
        return HostFacts(
            omp_threads=os.environ.get("OMP_NUM_THREADS"),
            cuda_visible=os.environ.get("CUDA_VISIBLE_DEVICES"),
            gpus_found=found[0],
            gpus_found_by=found[1],
        )

    def plan(self) -> LaunchPlan:
        """How a run would be laid out on the current Spark session (raises on bad settings)."""
        spark = self._session()
        cluster = read_cluster(spark) if spark is not None else ClusterInfo()
        return make_plan(self.config, cluster, host=self._host_facts(cluster))

    def run(self, main: Any, *args: Any, **kwargs: Any) -> Any:
        """Run ``main`` on every rank and return rank 0's result.

        ``main`` is a function, called as ``main(*args, **kwargs)`` on every rank (it is
        cloudpickled once here, with its arguments); the return value of rank 0 is returned.
        Or ``main`` is the path of a training script, run like ``torchrun script *args``
        (each argument through ``str()``); returns None, raises if any rank exits non-zero.

        With ``max_restarts=N``, a failed run restarts the whole gang (fresh rendezvous and
        port) up to N times; ranks see ``SPARK_TORCH_RESTART_COUNT`` to resume from their
        checkpoints. ``timeout`` bounds all attempts together.

        Raises:
            ValueError / TypeError (:class:`~spark_torch.ConfigurationError`,
                :class:`~spark_torch.PicklingError`): bad arguments, before anything starts.
            FileNotFoundError: the script does not exist.
            spark_torch.DistributedRunError: a rank failed (a ``RuntimeError``; the message
                leads with the failing rank, its host and the remote error).
            spark_torch.RunTimeoutError: ``timeout`` expired (also a ``TimeoutError``).
        """
        return self._run(main, args, kwargs, None)

    def run_on_dataframe(
        self, main: Any, df: Any, *args: Any, columns: Sequence[str] | None = None, **kwargs: Any
    ) -> Any:
        """Like :meth:`run`, with ``df``'s rows spread evenly over the ranks.

        Inside ``main``, :func:`spark_torch.data.rank_loader` (or ``rank_dataset``) iterates
        this rank's rows as batches of tensors: dicts by column name, or tuples in ``columns``
        order when ``columns`` is given. Rows go to ranks round-robin (deterministic for a
        given DataFrame), and every rank iterates the same number of rows per epoch (so DDP's
        all-reduces stay in step): with ``drop_last=False`` ranks with fewer rows repeat some
        of theirs, with ``drop_last=True`` ranks with more leave some out (docs/dataframe.md). In distributed mode every node
        receives its rows through the barrier stage itself (Arrow, no pandas); in local mode
        the driver reads the DataFrame. An empty DataFrame, or fewer rows than ranks, fails
        before training starts; so does a column type that cannot become a tensor.
        """
        from spark_torch.driver.dataframe import DataInput, check_columns

        chosen = check_columns(df.schema, columns)
        if self._spark is None and not self.config.local_mode:
            self._spark = df.sparkSession
        data = DataInput(df=df, columns=tuple(chosen), explicit=columns is not None)
        return self._run(main, args, kwargs, data)

    def _run(self, main: Any, args: tuple[Any, ...], kwargs: dict[str, Any], data: Any) -> Any:
        from spark_torch.driver.payload import dump_function_payload
        from spark_torch.errors import DistributedRunError, RunTimeoutError

        entry = make_entrypoint(main, args, kwargs)
        spark = self._session()
        cluster = read_cluster(spark) if spark is not None else ClusterInfo()
        host = self._host_facts(cluster)
        plan = make_plan(self.config, cluster, host=host)
        if plan.use_gpu and host.gpus_found and self.config.use_gpu is None:
            logger.info(
                "spark_torch: local mode on %d GPU(s) of this machine found by %s (%s); pass use_gpu=False to train on CPU",
                len(plan.local_gpus), host.gpus_found_by, ",".join(plan.local_gpus),
            )
        if cluster.ssl_enabled and not plan.local_mode:
            logger.warning(
                "spark_torch: Spark encryption is on but %s=true: rank-to-rank torch traffic is "
                "NOT encrypted", IGNORE_SSL_KEY
            )
        payload = dump_function_payload(entry) if isinstance(entry, FunctionEntrypoint) else None
        settings = resolve_settings(self.config.given_settings(), os.environ, cluster.torch_conf)
        endpoint = None if plan.local_mode else resolve_endpoint(cluster, settings)
        run_id = self.config.run_id or uuid.uuid4().hex[:12]
        token = uuid.uuid4().hex
        storage = self._storage(run_id, token)
        base = RunSpec(
            plan=plan,
            run_id=run_id,
            max_restarts=self.config.max_restarts,
            payload=payload,
            script=entry.path if isinstance(entry, ScriptEntrypoint) else None,
            script_argv=entry.argv if isinstance(entry, ScriptEntrypoint) else (),
            extra_env=self.config.env,
            cwd=os.getcwd(),
            driver_python=platform.python_version(),
            data=DataSpec(columns=data.columns, explicit=data.explicit) if data is not None else None,
            storage_base=storage.base if storage is not None else None,
            storage_token=token,
            settings=settings,
        )
        outcome = self.last_run = RunResult(run_id=run_id)
        deadline = time.monotonic() + self.config.timeout if self.config.timeout else None
        sink = DriverLogSink(self.config)
        tracker = ReportTracker(outcome, sink, self.config, plan, run_id)
        try:
            show = interactive() if self.config.progress is None else self.config.progress
            for restart in range(self.config.max_restarts + 1):
                latest = storage.latest() if storage is not None else None
                resume = latest.step if latest is not None else 0
                if storage is not None:
                    storage.discard_incomplete_after(resume)
                tracker.resume_from(resume)  # steps after the checkpoint will be reported again
                sink.status.close()
                sink.status = RunStatus(plan.world_size, enabled=show)
                attempt = Attempt(
                    spec=replace(
                        base, restart_count=restart, resume_step=resume, resume_url=latest.url if latest else None
                    ),
                    timeout=None if deadline is None else max(0.001, deadline - time.monotonic()),
                    run_timeout=self.config.timeout,
                    on_lines=sink,
                    tail=sink.tail,
                    on_row=tracker.row,
                    keep_checkpoints=self.config.keep_checkpoints,
                )
                outcome.restarts = restart
                try:
                    result = self._run_attempt(spark, attempt, endpoint, data)
                    break
                except RunTimeoutError:
                    raise
                except DistributedRunError as exc:
                    if restart >= self.config.max_restarts:
                        raise
                    logger.warning(
                        "spark_torch: run %s failed (%s); restarting the gang (%d of %d)",
                        run_id, str(exc).splitlines()[0], restart + 1, self.config.max_restarts,
                    )
            outcome.value = _unpickle_result(result)
            return outcome.value
        except BaseException as exc:
            outcome.error = exc
            raise
        finally:
            if storage is not None:
                latest = storage.latest()
                outcome.checkpoint = latest.url if latest is not None else None
            tracker.close()
            sink.status.close()
            sink.close()
            if storage is not None and self.config.run_id is None and self.config.storage_path is None:
                storage.remove_if_unused()  # a run that reported nothing leaves no empty directory

    def _storage(self, run_id: str, token: str) -> RunStorage | None:
        """The run's storage, created and marked now; without an explicit ``storage_path`` a
        default that cannot be created only disables checkpoints (with a warning)."""
        storage = RunStorage(self.config.storage_path or DEFAULT_STORAGE, run_id)
        try:
            storage.create(token)
        except (OSError, ValueError, ImportError) as exc:
            if self.config.storage_path is not None:
                raise ConfigurationError(
                    f"storage_path={self.config.storage_path!r}: cannot create the run's directory {storage.url} "
                    f"({type(exc).__name__}: {exc}); use a writable directory or an fsspec URL whose "
                    "filesystem package is installed (s3fs for s3://, gcsfs for gs://, adlfs for abfss://)"
                ) from exc
            logger.warning(
                "spark_torch: checkpoints are disabled: the default storage %s cannot be created (%s); "
                "pass storage_path= to use report(checkpoint=...)", storage.url, exc,
            )
            return None
        return storage

    def _run_attempt(self, spark: Any, attempt: Attempt, endpoint: ChannelEndpoint | None, data: Any) -> ResultBytes | None:
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
        from spark_torch.errors import DistributedRunError

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
