"""The public facade: :class:`Distributor`."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .attempt import Attempt
from .cluster import IGNORE_SSL_KEY, ClusterInfo, read_cluster
from .config import DistributorConfig
from .entrypoint import FunctionEntrypoint, make_entrypoint
from .logs import DriverLogSink
from .plan import LaunchPlan, make_plan
from .progress import RunStatus, interactive

if TYPE_CHECKING:
    from .serialization import ResultBytes

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
        progress: show a live status line (ranks started/running/finished/failed, elapsed) that
            ends as one summary line; None shows it only in a terminal or Jupyter.
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
        )
        self._spark = spark

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
        from .session import active_session, get_or_create_session

        return active_session() if self.config.local_mode else get_or_create_session()

    def plan(self) -> LaunchPlan:
        """How a run would be laid out on the current Spark session (raises on bad settings)."""
        spark = self._session()
        cluster = read_cluster(spark) if spark is not None else ClusterInfo()
        return make_plan(self.config, cluster)

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
        given DataFrame); each row belongs to exactly one rank. In distributed mode every node
        receives its rows through the barrier stage itself (Arrow, no pandas); in local mode
        the driver reads the DataFrame. An empty DataFrame, or fewer rows than ranks, fails
        before training starts; so does a column type that cannot become a tensor.
        """
        from .dataframe import DataInput, check_columns

        chosen = check_columns(df.schema, columns)
        if self._spark is None and not self.config.local_mode:
            self._spark = df.sparkSession
        data = DataInput(df=df, columns=tuple(chosen), explicit=columns is not None)
        return self._run(main, args, kwargs, data)

    def _run(self, main: Any, args: tuple[Any, ...], kwargs: dict[str, Any], data: Any) -> Any:
        from . import serialization
        from .errors import DistributedRunError, RunTimeoutError

        entry = make_entrypoint(main, args, kwargs)
        spark = self._session()
        cluster = read_cluster(spark) if spark is not None else ClusterInfo()
        plan = make_plan(self.config, cluster)
        if cluster.ssl_enabled and not plan.local_mode:
            logger.warning(
                "spark_torch: Spark encryption is on but %s=true: rank-to-rank torch traffic is "
                "NOT encrypted", IGNORE_SSL_KEY
            )
        payload = serialization.dump_function_payload(entry) if isinstance(entry, FunctionEntrypoint) else None
        run_id = uuid.uuid4().hex[:12]
        deadline = time.monotonic() + self.config.timeout if self.config.timeout else None
        sink = DriverLogSink(self.config)
        try:
            show = interactive() if self.config.progress is None else self.config.progress
            for restart in range(self.config.max_restarts + 1):
                sink.status.close()
                sink.status = RunStatus(plan.world_size, enabled=show)
                attempt = Attempt(
                    run_id=run_id,
                    restart_count=restart,
                    max_restarts=self.config.max_restarts,
                    timeout=None if deadline is None else max(0.001, deadline - time.monotonic()),
                    run_timeout=self.config.timeout,
                    extra_env=self.config.env,
                    on_lines=sink,
                    tail=sink.tail,
                )
                try:
                    result = self._run_attempt(spark, cluster, plan, entry, payload, attempt, data)
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
        finally:
            sink.status.close()
            sink.close()
        return _unpickle_result(result)

    def _run_attempt(
        self,
        spark: Any,
        cluster: ClusterInfo,
        plan: LaunchPlan,
        entry: Any,
        payload: bytes | None,
        attempt: Attempt,
        data: Any,
    ) -> ResultBytes | None:
        if plan.local_mode:
            from .local_mode import run_local

            return run_local(plan, entry, payload, attempt, data)
        from .barrier import run_distributed

        return run_distributed(spark, plan, entry, payload, attempt, driver_host=cluster.driver_host, data=data)


def _unpickle_result(result: ResultBytes | None) -> Any:
    """Rank 0's value; the bytes came from this run's own file or Spark's result channel."""
    if result is None:
        return None
    import cloudpickle

    try:
        return cloudpickle.loads(result)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure gets the same advice
        from .errors import DistributedRunError

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
