"""The public facade: :class:`Distributor`."""

from __future__ import annotations

import difflib
import inspect
import logging
import os
import sysconfig
import threading
import types
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from spark_torch.base.envnames import FULL_TRACEBACK
from spark_torch.driver.config import DistributorConfig
from spark_torch.driver.result import RunResult
from spark_torch.driver.run.entrypoint import Entrypoint, make_entrypoint
from spark_torch.driver.run.plan import host_facts, make_plan
from spark_torch.driver.run_record import RunRecord
from spark_torch.driver.spark.cluster import ClusterInfo, read_cluster
from spark_torch.errors import ConfigurationError
from spark_torch.ft.lighthouse import LighthouseOptions
from spark_torch.settings import SETTINGS
from spark_torch.shared.spec import LaunchPlan

if TYPE_CHECKING:
    from spark_torch.driver.spark.dataframe import DataInput

__all__ = ["Distributor", "run_entrypoint", "without_internal_frames"]

logger = logging.getLogger(__name__)


def _not_users() -> tuple[str, ...]:
    """The folders whose frames are not the user's: spark_torch's own, the standard library's and
    the installed packages' (fsspec, cloudpickle, pyspark...): nothing the user can change."""
    package = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    paths = sysconfig.get_paths()
    folders = {package, *(paths[key] for key in ("stdlib", "platstdlib", "purelib", "platlib") if key in paths)}
    return tuple(os.path.join(os.path.abspath(folder), "") for folder in folders)


def _users_frames(tb: types.TracebackType | None) -> types.TracebackType | None:
    """``tb`` with the user's frames only (the script's or notebook's, their own modules')."""
    not_users, kept = _not_users(), []
    while tb is not None:
        if not os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(not_users):
            kept.append(tb)
        tb = tb.tb_next
    chain = None
    for entry in reversed(kept):
        chain = types.TracebackType(chain, entry.tb_frame, entry.tb_lasti, entry.tb_lineno)
    return chain


def without_internal_frames(error: BaseException) -> None:
    """Make ``error`` what the user should see leave a public entry point (it is re-raised): the
    user's own frames only (none of spark_torch's, the standard library's or an installed
    package's, in its traceback and its causes': the message says what happened and what to do),
    without the exceptions spark_torch happened to be handling (``__context__``; an explicit cause
    stays, as its one line). With ``SPARK_TORCH_FULL_TRACEBACK=1`` (docs/troubleshooting.md) it
    is left whole."""
    if os.environ.get(FULL_TRACEBACK, "").strip().lower() in ("1", "true", "yes", "on"):
        return
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        current.__traceback__ = _users_frames(current.__traceback__)
        if current.__cause__ is None:
            current.__suppress_context__ = True
        current = current.__cause__


def _parameters() -> list[str]:
    """The keyword parameters of ``Distributor()`` (the main three first), from its signature."""
    signature = inspect.signature(Distributor.__init__)
    return [p.name for p in signature.parameters.values() if p.name != "self" and p.kind is not p.VAR_KEYWORD]


def _settings(given: dict[str, Any]) -> dict[str, Any]:
    """The ``**settings`` keywords, checked against the table of settings; an unknown one (a
    misspelt parameter lands here too) is a TypeError with the closest name, the parameters and
    the settings."""
    names = [s.name for s in SETTINGS]
    unknown = sorted(set(given) - set(names))
    if unknown:
        parameters = _parameters()
        hints = [
            f"{u!r} (did you mean {close[0]!r}?)"
            if (close := difflib.get_close_matches(u, parameters + names, 1))
            else repr(u)
            for u in unknown
        ]
        raise TypeError(
            f"Distributor() got unexpected keyword argument(s) {', '.join(hints)}; its main parameters are "
            f"{', '.join(parameters[:3])}, its other parameters {', '.join(parameters[3:])}, and its settings "
            f"{', '.join(names)} (docs/configuration.md)"
        )
    return given


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
        max_restarts: restart the whole gang up to this many times when a rank fails (-1:
            without limit; ``timeout`` still bounds the whole run).
        ranks_per_task: distributed CPU mode: ranks per barrier task (node), default 1; set
            ``spark.task.cpus`` to the cores they share. With GPUs it is the task's GPU count.
        progress: show a live status line (ranks started/running/finished/failed, elapsed, the
            latest reported metrics) that ends as one summary line; None shows it only in a
            terminal or Jupyter (where a chart of the reported metrics is drawn too).
        storage_path: where :func:`spark_torch.report` persists checkpoints and metrics: a
            directory or an fsspec URL (``s3://...``, ``gs://...``; ``dbfs:/...`` is the ``/dbfs``
            mount on Databricks); default ``~/spark_torch_runs``. Runs whose ranks are on several
            hosts need storage every host can reach.
        storage_options: fsspec's keyword arguments for that storage (credentials, endpoint,
            e.g. ``{"key": ..., "secret": ..., "client_kwargs": {"endpoint_url": ...}}`` for S3);
            they reach the ranks in a private file, never in their environment or a log.
        run_id: the run's name under ``storage_path``; giving an existing one resumes from its
            latest checkpoint (default: a fresh id, see ``last_run.run_id``).
        keep_checkpoints: keep only this many checkpoints (default: all): the newest, or the
            best by ``checkpoint_score_attribute``; the latest is always kept too.
        checkpoint_score_attribute: a reported metric that ranks the checkpoints:
            ``keep_checkpoints`` keeps the best and ``last_run.best_checkpoints`` lists them best first.
        checkpoint_score_order: ``"max"`` (the default: higher is better) or ``"min"``.
        min_processes: distributed mode: the fewest ranks the run goes on with (default
            ``num_processes``: a fixed size). With fewer slots than ``num_processes`` it starts
            with as many whole nodes as fit; after a lost node it restarts (``max_restarts``)
            with the nodes there are, from the latest checkpoint. ``last_run.attempts`` says
            each attempt's size and why (docs/elastic.md).
        elastic_grow: an attempt below full size restarts larger, at its next checkpoint, once
            slots for more nodes have been free for ``elastic_wait`` seconds.
        mlflow: log the reported metrics, parameters and the final checkpoint to one MLflow
            run (None: when an MLflow run is active on the driver).
        replica_groups: per-step fault tolerance with torchft: the ranks form this many replica
            groups of ``num_processes // replica_groups`` ranks (it must divide ``num_processes``;
            whole nodes in distributed mode, a barrier job per group), each its own gang with
            its own ``max_restarts`` budget;
            the driver hosts a torchft lighthouse and a failed group restarts alone and heals
            from its peers (``spark_torch.ft.manager()`` inside the function). ``run()``
            returns group 0's rank-0 value (docs/fault-tolerance.md). 1: today's single gang.
        lighthouse_options: the lighthouse's quorum rules with ``replica_groups``
            (``spark_torch.ft.lighthouse.LighthouseOptions``; default: ``LighthouseOptions()``,
            which drops a silent group after 1 s, torchft's default being 5 s).
        **settings: any setting of the table in docs/configuration.md by its keyword
            (``stall_timeout=300``, ``warm_start=False``, ``channel_host="10.0.0.5"``, ...);
            each can also come from an environment variable or a Spark conf key. An unknown
            keyword raises ``TypeError`` with the closest parameter or setting ("did you mean"),
            and names the parameters and the settings there are.
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
        storage_options: Mapping[str, Any] | None = None,
        checkpoint_score_attribute: str | None = None,
        checkpoint_score_order: str = "max",
        min_processes: int | None = None,
        elastic_grow: bool = False,
        replica_groups: int = 1,
        lighthouse_options: LighthouseOptions | None = None,
        **settings: Any,
    ) -> None:
        #: the checked options (internal: read them through the properties below)
        self._config = DistributorConfig(
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
            storage_options=dict(storage_options or {}),
            checkpoint_score_attribute=checkpoint_score_attribute,
            checkpoint_score_order=checkpoint_score_order,
            min_processes=min_processes,
            elastic_grow=elastic_grow,
            replica_groups=replica_groups,
            lighthouse_options=lighthouse_options,
            **_settings(settings),
        )
        self._spark = spark
        #: the outcome of the latest run() (value, metrics, checkpoint, restarts, error)
        # per thread: two run() calls at once on one instance (threads of a notebook or a
        # service) each see their own result
        self._results = threading.local()

    @property
    def last_run(self) -> RunResult | None:
        """The outcome of this thread's latest ``run()``/``run_on_dataframe()`` on this instance
        (value, metrics and their history, checkpoints, restarts, error), or None."""
        result: RunResult | None = getattr(self._results, "last", None)
        return result

    def _keep_last(self, result: RunResult) -> None:
        """Publish ``result`` as this thread's :attr:`last_run`."""
        self._results.last = result

    @property
    def num_processes(self) -> int:
        """Total number of ranks."""
        return self._config.num_processes

    @property
    def local_mode(self) -> bool:
        """Whether ranks run on the driver machine."""
        return self._config.local_mode

    def _session(self) -> Any | None:
        if not self._config.local_mode:
            from spark_torch.driver.spark.pyspark_shims import check_pyspark

            check_pyspark()  # before a session is started or used
        if self._spark is not None:
            return self._spark
        from spark_torch.driver.spark.session import active_session, get_or_create_session

        return active_session() if self._config.local_mode else get_or_create_session()

    def plan(self) -> LaunchPlan:
        """How a run would be laid out on the current Spark session (raises on bad settings)."""
        spark = self._session()
        cluster = read_cluster(spark) if spark is not None else ClusterInfo()
        return make_plan(
            self._config, cluster, host=host_facts(self._config.local_mode, self._config.use_gpu, cluster, os.environ)
        )

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
                :class:`~spark_torch.PicklingError`, :class:`~spark_torch.errors.ArgumentError`
                when ``args``/``kwargs`` do not fit ``main``'s signature): bad arguments, before
                anything starts.
            FileNotFoundError: the script does not exist.
            spark_torch.DistributedRunError: a rank failed (a ``RuntimeError``; the message
                leads with the failing rank, its host and the remote error).
            spark_torch.RunTimeoutError: ``timeout`` expired (also a ``TimeoutError``).
        """
        try:
            return self._run(main, args, kwargs, None)
        except BaseException as error:  # every error leaves without spark_torch's frames
            without_internal_frames(error)
            raise

    def run_on_dataframe(
        self,
        main: Any,
        df: Any,
        *args: Any,
        columns: Sequence[str] | None = None,
        reuse_staged: bool = False,
        **kwargs: Any,
    ) -> Any:
        """Like :meth:`run`, with ``df``'s rows spread evenly over the ranks.

        Inside ``main``, :func:`spark_torch.data.rank_loader` (or ``rank_dataset``) iterates
        this rank's rows as batches of tensors: dicts by column name, or tuples in ``columns``
        order when ``columns`` is given. Rows go to nodes round-robin and to a node's ranks in
        contiguous blocks (deterministic for a given DataFrame), and every rank iterates the same number of rows per
        epoch (so DDP's
        all-reduces stay in step): with ``drop_last=False`` ranks with fewer rows repeat some
        of theirs, with ``drop_last=True`` ranks with more leave some out (docs/dataframe.md). In distributed mode
        every node
        receives its rows through the barrier stage itself (Arrow, no pandas); in local mode
        the driver reads the DataFrame. An empty DataFrame, or fewer rows than ranks, fails
        before training starts; so does a column type that cannot become a tensor.

        With ``reuse_staged=True`` the staged rows are kept until the Spark session stops, and a
        later call on the same DataFrame (the same plan, columns and layout) trains on them
        without reading the DataFrame again (``RunResult.staging`` says which happened;
        docs/dataframe.md says what "the same" means). Not under Spark Connect.
        """
        from spark_torch.driver.spark.dataframe import DataInput, check_columns

        try:
            if not isinstance(reuse_staged, bool):
                raise ConfigurationError(f"reuse_staged must be True or False, got {reuse_staged!r}")
            chosen = check_columns(df.schema, columns)
            if self._spark is None and not self._config.local_mode:
                self._spark = df.sparkSession
            digest = None
            if reuse_staged:
                from spark_torch.driver.spark.staged_reuse import plan_digest

                digest = plan_digest(df)
            data = DataInput(df=df, columns=tuple(chosen), explicit=columns is not None, digest=digest)
            return self._run(main, args, kwargs, data)
        except BaseException as error:  # every error leaves without spark_torch's frames
            without_internal_frames(error)
            raise

    def _run(self, main: Any, args: tuple[Any, ...], kwargs: dict[str, Any], data: DataInput | None) -> Any:
        return run_entrypoint(self, make_entrypoint(main, args, kwargs), data)


def run_entrypoint(distributor: Distributor, entry: Entrypoint, data: DataInput | None = None) -> Any:
    """Run ``entry`` with ``distributor``'s options and session, recording it as its ``last_run``:
    what :meth:`Distributor.run` does once it has made the entrypoint (the DeepSpeed distributor
    builds its own, with DeepSpeed's arguments)."""
    from spark_torch.driver.run.controller import execute, new_run_id

    config = distributor._config
    if config.replica_groups > 1:  # a layer above the run: one run per group (docs/fault-tolerance.md)
        from spark_torch.driver.api.replica_groups import run_groups

        return run_groups(config, entry, data, distributor._session(), distributor._keep_last)
    spark = distributor._session()
    record = RunRecord(run_id=config.run_id or new_run_id())
    try:
        return execute(config, spark, entry, data, record)
    finally:  # the call's result, made once as it ended (or only its id: it failed before it ran)
        distributor._keep_last(record.final())
