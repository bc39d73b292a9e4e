"""One ``run()`` on the driver, start to end: plan, payload, settings, storage, then the
attempts (restarting the gang up to ``max_restarts`` times), and rank 0's value."""

from __future__ import annotations

import logging
import math
import os
import platform
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any

from spark_torch.base.states import ProblemKind
from spark_torch.driver.attempts import END_RULES
from spark_torch.driver.config import DistributorConfig
from spark_torch.driver.console.logs import DriverLogSink, replica_group_of
from spark_torch.driver.console.status import interactive
from spark_torch.driver.console.tracker import ReportTracker
from spark_torch.driver.result import AttemptError, AttemptReason, AttemptRecord, StoredRun, read_stored
from spark_torch.driver.run.attempt import Attempt
from spark_torch.driver.run.call_storage import (
    newest_checkpoint,
    open_storage,
    prune_default,
    record_attempt_end,
    run_outcome,
)
from spark_torch.driver.run.cancel import Cancellation
from spark_torch.driver.run.endpoints import ChannelEndpoint, resolve_endpoint
from spark_torch.driver.run.entrypoint import Entrypoint, FunctionEntrypoint, ScriptEntrypoint
from spark_torch.driver.run.failures import attempt_error, unreadable_result_error
from spark_torch.driver.run.flight_recorder import trace_dir
from spark_torch.driver.run.membership import Membership
from spark_torch.driver.run.outcome import AttemptOutcome, GrowRequested, Interrupted, StartProblem
from spark_torch.driver.run.payload import dump_function_payload
from spark_torch.driver.run.plan import LaunchPlan, host_facts, make_plan
from spark_torch.driver.run.policy import Action, RestartPolicy
from spark_torch.driver.run_record import RunRecord
from spark_torch.driver.spark.checks import Verdict, encryption_checks
from spark_torch.driver.spark.cluster import ClusterInfo, read_cluster
from spark_torch.driver.spark.dataframe import DataInput
from spark_torch.driver.spark.preflight import check_executors
from spark_torch.driver.spark.quiet import quiet_spark_logs
from spark_torch.errors import (
    InsufficientSlotsError,
    LaunchError,
)
from spark_torch.ft.install import MODULE as FT_MODULE
from spark_torch.ft.install import install_hint
from spark_torch.reporting.run_log import call_row, end_row
from spark_torch.reporting.run_log import record as log_call
from spark_torch.reporting.storage import RunStorage, storage_error
from spark_torch.settings import Settings
from spark_torch.settings import resolve as resolve_settings
from spark_torch.shared.rank_files import ResultBytes
from spark_torch.shared.spec import DataSpec, RunSpec, StorageSpec
from spark_torch.version import package_identity

__all__ = ["execute", "new_run_id"]

logger = logging.getLogger(__name__)


def new_run_id() -> str:
    """A fresh run id (12 hex digits)."""
    return uuid.uuid4().hex[:12]


def _plan(config: DistributorConfig, cluster: ClusterInfo) -> LaunchPlan:
    """The run's layout, and what the user should know about it (GPUs found or not used,
    traffic that Spark encrypts and torch does not)."""
    host = host_facts(config.local_mode, config.use_gpu, cluster, os.environ)
    plan = make_plan(config, cluster, host=host)
    if plan.use_gpu and host.gpus_found and config.use_gpu is None:
        logger.info(
            "spark_torch: local mode on %d GPU(s) of this machine found by %s (%s); pass use_gpu=False to train on CPU",
            len(plan.local_gpus),
            host.gpus_found_by,
            ",".join(plan.local_gpus),
        )
    if plan.gpu_fallback is not None:
        logger.warning("%s", plan.gpu_fallback)
    if not plan.local_mode:  # the checks doctor shows too, one table (driver/spark/checks.py)
        for check in encryption_checks(cluster):
            if check.verdict is Verdict.WARN:
                logger.warning("%s", check.message)
    return plan


def _run_spec(
    config: DistributorConfig,
    plan: LaunchPlan,
    entry: Entrypoint,
    payload: bytes | None,
    data: DataInput | None,
    run_id: str,
    storage: RunStorage | None,
    token: str,
    settings: Settings,
) -> RunSpec:
    """The run as every node sees it (one immutable spec; each attempt replaces its size)."""
    script = entry if isinstance(entry, ScriptEntrypoint) else None
    return RunSpec(
        plan=plan,
        run_id=run_id,
        max_restarts=config.max_restarts,
        payload=payload,
        script=script.path if script is not None else None,
        script_argv=script.argv if script is not None else (),
        files=dict(script.files) if script is not None else {},
        extra_env=config.env,
        cwd=os.getcwd(),
        driver_python=platform.python_version(),
        driver_package=package_identity(),
        data=DataSpec(columns=data.columns, explicit=data.explicit) if data is not None else None,
        storage=StorageSpec(
            base=storage.base, token=token, options=storage.options, required=config.storage_path is not None
        )
        if storage is not None
        else None,
        settings=settings,
        lighthouse_secret=config.lighthouse_secret,
    )


def _membership(config: DistributorConfig, plan: LaunchPlan, settings: Settings) -> Membership | None:
    """The sizes a distributed run may take (None in local mode)."""
    if plan.local_mode:
        return None
    minimum = config.min_processes or config.num_processes
    return Membership(
        max_nodes=plan.num_nodes,
        min_nodes=max(1, math.ceil(minimum / plan.procs_per_node)),
        procs_per_node=plan.procs_per_node,
        elastic_wait=settings.elastic_wait,
        executor_wait=settings.executor_wait,
    )


def execute(
    config: DistributorConfig,
    spark: Any,
    entry: Entrypoint,
    data: DataInput | None,
    record: RunRecord,
    cancellation: Cancellation | None = None,
    *,
    restart: bool = False,
    restarts_before: int = 0,
) -> Any:
    """Run ``entry`` (see :meth:`Distributor.run`), recording it in ``record``; once it ended,
    however, ``record.result`` is the call's :class:`~spark_torch.driver.result.RunResult`.
    ``cancellation`` stops its attempts from another thread (replica groups). ``restart``: this
    continues the run's previous call (a replica group restarted alone after a rank failure): the
    run's log gets no new call (``spark-torch runs show`` lists one) and the first attempt is a
    restart after a failure, not a start; ``restarts_before``: the group's restarts before this
    call, on which its ranks' ``TORCHELASTIC_RESTART_COUNT`` counts on."""
    cluster = read_cluster(spark) if spark is not None else ClusterInfo()
    plan = _plan(config, cluster)
    settings = resolve_settings(config.given_settings(), os.environ, cluster.torch_conf)
    # a function that does not pickle fails here, before anything is created
    payload = dump_function_payload(entry) if isinstance(entry, FunctionEntrypoint) else None
    endpoint = None if plan.local_mode else resolve_endpoint(cluster, settings)
    token = uuid.uuid4().hex
    sink = DriverLogSink(config, plan.world_size)  # raises before anything is created for a bad log_dir
    try:
        storage = open_storage(config, record.run_id, token)
    except BaseException:
        sink.close()
        raise
    record.started, script = time.time(), entry if isinstance(entry, ScriptEntrypoint) else None
    call = call_row(
        entry.description, "script" if script else "function", script.argv if script else (), started=record.started
    )
    record.entry = call["entry"]
    if not restart:  # a restart's attempts and end belong to the call it continues
        log_call(storage, call)  # what this call runs, for `spark-torch runs` (its end is recorded below)
    base = _run_spec(config, plan, entry, payload, data, record.run_id, storage, token, settings)
    deadline = time.monotonic() + config.timeout if config.timeout else None
    tracker = ReportTracker(record, sink, config, plan, record.run_id)
    membership = _membership(config, plan, settings)
    controller = RunController(
        spark=spark,
        base=base,
        plan=plan,
        config=config,
        endpoint=endpoint,
        data=data,
        record=record,
        sink=sink,
        tracker=tracker,
        storage=storage,
        membership=membership,
        deadline=deadline,
        policy=RestartPolicy(config.max_restarts),
        cancellation=cancellation,
        first_reason=AttemptReason.RESTART_AFTER_FAILURE if restart else AttemptReason.START,
        restarts_before=restarts_before,
    )
    value: Any = None
    error: BaseException | None = None
    try:
        with quiet_spark_logs(None if plan.local_mode else spark, keep=settings.spark_logs):  # no Java wall
            pickled = controller.run()
        value = _unpickle_result(pickled)
        return value
    except BaseException as exc:
        error = exc
        raise
    finally:
        ended = time.time()
        outcome = run_outcome(error, controller.last)
        log_call(storage, end_row(outcome, error, ended))
        try:
            stored = read_stored(storage, record.rows, config.checkpoint_score_attribute, config.checkpoint_score_order)
        except Exception as exc:  # noqa: BLE001 - the run's own outcome or error matters more
            logger.warning(
                "spark_torch: the run's history and checkpoints could not be read back: %s",
                storage_error(str(storage and storage.url), exc),
            )
            stored = StoredRun(path=storage.url if storage is not None else None, history=list(record.rows))
        result = record.finish(value=value, error=error, outcome=outcome, ended=ended, stored=stored)
        tracker.close(result.checkpoint, result.error)
        sink.close()
        if storage is not None and config.run_id is None and config.storage_path is None:
            prune_default(storage)  # the default storage keeps the newest runs that reported nothing, not all


def _run_attempt(
    spark: Any, attempt: Attempt, endpoint: ChannelEndpoint | None, data: DataInput | None
) -> AttemptOutcome:
    """One attempt; both modes return every way it ends as a typed outcome (an interrupt that
    comes before the attempt's own wait, while it ships or stages, too)."""
    cancellation = attempt.cancellation
    if cancellation is not None and cancellation.error is not None:  # stopped before it started
        return AttemptOutcome.ended(Interrupted(cancellation.error))
    try:
        if endpoint is None:
            from spark_torch.driver.run.local import run_local

            return run_local(attempt, data)
        from spark_torch.driver.run.barrier import run_distributed

        return run_distributed(spark, attempt, endpoint, data)
    except KeyboardInterrupt as interrupt:
        return AttemptOutcome.ended(Interrupted(interrupt))


@dataclass
class RunController:
    """The attempts of one run: start an attempt sized by the membership, let the
    :class:`RestartPolicy` decide from how it ended (finish, restart, raise), record it."""

    spark: Any
    base: RunSpec
    plan: LaunchPlan
    config: DistributorConfig
    endpoint: ChannelEndpoint | None
    data: DataInput | None
    record: RunRecord
    sink: DriverLogSink
    tracker: ReportTracker
    storage: RunStorage | None
    membership: Membership | None
    deadline: float | None
    #: decides finish, restart or raise after each attempt (pure; see driver/run/policy.py)
    policy: RestartPolicy
    #: the history index (``AttemptRecord.attempt``) of this call's first attempt: a resumed
    #: run_id counts on from its history; an attempt's index is this plus its ``restart_count``
    first_attempt: int = 0
    #: stops the attempts from another thread (replica groups)
    cancellation: Cancellation | None = None
    #: why the first attempt starts (a replica group restarted alone: after a failure)
    first_reason: AttemptReason = AttemptReason.START
    #: restarts before this call's first attempt (a replica group's earlier calls): the ranks'
    #: restart count counts on from it
    restarts_before: int = 0
    #: how the attempt that ended last ended (None while one is being set up or runs)
    last: AttemptOutcome | None = None

    def run(self) -> ResultBytes | None:
        """Attempts until one succeeds (rank 0's pickled value) or the policy raises its error."""
        policy = self.policy
        self.first_attempt = self.storage.next_attempt() if self.storage is not None else 0
        show = interactive() if self.config.progress is None else self.config.progress
        reason, failures = self.first_reason, 0
        while True:
            self.last = None
            record, attempt, problem = self._next_attempt(len(self.record.attempts), reason, show)
            # a check before the attempt that found it impossible ends it as the attempt would have
            ended = (
                AttemptOutcome.ended(problem)
                if problem is not None
                else _run_attempt(self.spark, attempt, self.endpoint, self.data)
            )
            record.end, self.last = ended.end, ended
            if ended.staging is not None:
                self.record.staging = ended.staging
            # the edge: the attempt's typed end becomes the user's exception here, and only here
            error = attempt_error(ended) if END_RULES[ended.end].error else None
            record.error = AttemptError.from_exception(error) if error is not None else None
            record.grow = ended.cause.request if isinstance(ended.cause, GrowRequested) else None
            record_attempt_end(self.storage, record)
            decision = policy.decide(ended.end, failures)
            if decision.action is Action.FINISH:
                return ended.result
            if decision.action is Action.RAISE:
                assert error is not None
                raise error
            assert decision.reason is not None
            failures += decision.counts
            if decision.counts:
                stacks = getattr(error, "stacks_text", None)  # a stall's or a timeout's: said here, once
                logger.warning(
                    "spark_torch: run %s %s (%s); restarting the gang (%d of %s)%s",
                    self.record.run_id,
                    ended.end,
                    record.detail,
                    failures,
                    policy.budget(),
                    f"\nWhere each rank was:\n{stacks}" if stacks else "",
                )
            reason = decision.reason

    def _next_attempt(
        self, restart_count: int, reason: AttemptReason, show: bool
    ) -> tuple[AttemptRecord, Attempt, StartProblem | None]:
        """The record and the attempt after ``restart_count`` restarts within this call, and the
        problem that makes it impossible when the checks before it found one (too few slots,
        executors whose Python cannot run a node): the attempt then ends with it, unstarted."""
        index = self.first_attempt + restart_count  # in the run's history
        storage = self.storage
        latest = newest_checkpoint(storage, self.config.peer_runs) if storage is not None else None
        resume = latest.step if latest is not None else 0
        if storage is not None:
            storage.discard_incomplete_after(resume)
        self.tracker.resume_from(resume)  # steps after the checkpoint will be reported again
        sized, size, problem = self.plan, None, None
        if self.membership is not None and self.spark is not None:
            try:
                size = self.membership.nodes_for(self.spark, first=restart_count == 0)
                # their Python (and torchft for a replica group's ranks), before the barrier stage
                check_executors(self.spark, size.nodes, self.base.settings.ship_package, _needed(self.config))
                sized = replace(self.plan, num_nodes=size.nodes)
            except (InsufficientSlotsError, LaunchError) as exc:
                kind = ProblemKind.SLOTS if isinstance(exc, InsufficientSlotsError) else ProblemKind.LAUNCH
                problem = StartProblem.of(kind, str(exc), cause=exc.__cause__)
        record = AttemptRecord(
            attempt=index, world_size=sized.world_size, nodes=sized.num_nodes, reason=reason, size=size
        )
        self.record.attempts.append(record)
        status = self.sink.begin_attempt(
            sized.world_size, show and problem is None
        )  # none for an attempt that cannot start
        config = self.config
        attempt = Attempt(
            spec=replace(
                self.base,
                plan=sized,
                restart_count=self.restarts_before + restart_count,
                resume_step=resume,
                resume_url=latest.url if latest else None,
            ),
            timeout=None if self.deadline is None else max(0.001, self.deadline - time.monotonic()),
            run_timeout=config.timeout,
            on_lines=self.sink,
            attempt=index,
            tail=self.sink.tail,
            on_row=self.tracker.row,
            keep_checkpoints=config.keep_checkpoints,
            score_attribute=config.checkpoint_score_attribute,
            score_order=config.checkpoint_score_order,
            membership=self.membership if config.elastic_grow else None,
            on_stall=status.stalled,
            trace_dir=trace_dir(config.log_dir, self.record.run_id, index),
            cancellation=self.cancellation,
        )
        return record, attempt, problem


def _needed(config: DistributorConfig) -> dict[str, str]:
    """The modules a run needs on the executors beyond a node's, each with its install hint: a
    replica group's ranks import torchft (a rank's ImportError would spend the group's restarts)."""
    return (
        {FT_MODULE: f"replica_groups needs {FT_MODULE}: {install_hint()}"}
        if replica_group_of(config) is not None
        else {}
    )


def _unpickle_result(result: ResultBytes | None) -> Any:
    """Rank 0's value; the bytes came from this run's own file or Spark's result channel."""
    if result is None:
        return None
    import cloudpickle

    try:
        return cloudpickle.loads(result)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure gets the same advice
        raise unreadable_result_error(exc) from exc
    finally:
        close = getattr(result, "close", None)  # a memory map of the result file
        if close is not None:
            close()
