"""The public facade: :class:`Distributor`."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping
from typing import Any

from .cluster import ClusterInfo, read_cluster
from .config import DistributorConfig
from .entrypoint import FunctionEntrypoint, make_entrypoint
from .logs import DriverLogSink
from .plan import LaunchPlan, make_plan

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
    ) -> None:
        self.config = DistributorConfig(
            num_processes=num_processes,
            local_mode=local_mode,
            use_gpu=use_gpu,
            env=dict(env or {}),
            timeout=timeout,
            log_ranks=log_ranks,
            log_dir=log_dir,
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

        Raises:
            ValueError / TypeError (:class:`~spark_torch.ConfigurationError`,
                :class:`~spark_torch.PicklingError`): bad arguments, before anything starts.
            FileNotFoundError: the script does not exist.
            spark_torch.DistributedRunError: a rank failed (a ``RuntimeError``; the message
                leads with the failing rank, its host and the remote error).
            spark_torch.RunTimeoutError: ``timeout`` expired (also a ``TimeoutError``).
        """
        from . import serialization

        entry = make_entrypoint(main, args, kwargs)
        plan = self.plan()
        payload = serialization.dump_function_payload(entry) if isinstance(entry, FunctionEntrypoint) else None
        run_id = uuid.uuid4().hex[:12]
        sink = DriverLogSink(self.config)
        try:
            if plan.local_mode:
                from .local_mode import run_local

                result = run_local(
                    plan,
                    entry,
                    payload,
                    run_id=run_id,
                    extra_env=dict(self.config.env),
                    on_line=sink,
                    timeout=self.config.timeout,
                )
            else:
                from .barrier import run_distributed

                spark = self._session()
                result = run_distributed(
                    spark,
                    plan,
                    entry,
                    payload,
                    run_id=run_id,
                    extra_env=dict(self.config.env),
                    timeout=self.config.timeout,
                    on_line=sink,
                    driver_host=read_cluster(spark).driver_host,
                )
        finally:
            sink.close()
        if result is None:
            return None
        import cloudpickle

        try:
            return cloudpickle.loads(result)
        except Exception as exc:
            from .errors import DistributedRunError

            raise DistributedRunError(
                [],
                headline=f"rank 0 returned a result that cannot be unpickled on the driver "
                f"({type(exc).__name__}: {exc}); return plain data (numbers, lists, dicts, tensors, "
                "state_dict()) or make the classes it uses importable on the driver",
            ) from exc
