"""``replica_groups=G``: per-step fault tolerance with torchft, a layer above today's run.

The driver hosts the run's torchft lighthouse (:class:`~spark_torch.ft.lighthouse.Lighthouse`, on
loopback in local mode, on the channel's address in distributed mode, where the ranks reach it
through their node's relay, which proves a secret of this call: :mod:`spark_torch.ft.node_relay`) and runs each
replica group
as its own gang: one thread per group, each an attempt loop (:class:`GroupLoop`) of ordinary runs
(``execute``: in distributed mode a barrier job per group, of whole nodes) of
``num_processes / G`` ranks named ``RUN_ID-gN``, with its own ``max_restarts`` budget. A group whose rank fails restarts
alone; the other groups keep their processes and lose at most the step in flight (torchft's
quorum drops the lost group and its Manager heals the restarted one from a peer). A group past
its budget, or one that ends with an error that a restart does not cure (a bad argument, the
timeout), fails the run: the lighthouse is stopped at once, so the other groups' ranks fail at
their next quorum and are not restarted, and :class:`~spark_torch.ReplicaGroupError` names the
group. Ctrl-C is raised in every group's thread too, so each group's run stops its ranks. The lighthouse is stopped
whatever the end. ``run()`` returns group 0's rank-0
value; ``last_run`` is the whole run (:func:`merged_result`, Ctrl-C included): every group's
report() rows, each with its ``replica_group``, and every group's attempts. A run whose groups
never created a torchft Manager (the lighthouse never heard from them:
:mod:`~spark_torch.driver.api.manager_watch`) trained copies that never synced, and says so.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from spark_torch.base.grace import DRIVER_STOP_WAIT_SECONDS
from spark_torch.channel.driver_end import new_secret
from spark_torch.driver.api.manager_watch import ManagerWatch
from spark_torch.driver.config import DistributorConfig
from spark_torch.driver.group_runs import group_run_id
from spark_torch.driver.result import RunResult, merge_groups, restarts_of
from spark_torch.driver.run.cancel import Cancellation, RunCancelled
from spark_torch.driver.run.controller import execute, new_run_id
from spark_torch.driver.run.endpoints import resolve_endpoint
from spark_torch.driver.run.entrypoint import Entrypoint
from spark_torch.driver.run_record import RunRecord
from spark_torch.driver.spark.cluster import executor_hosts, is_connect_session, read_cluster
from spark_torch.errors import ConfigurationError, DistributedRunError, ReplicaGroupError, RunTimeoutError
from spark_torch.ft import rank_ends
from spark_torch.ft.env import GroupEnv
from spark_torch.ft.lighthouse import Lighthouse
from spark_torch.reporting.run_log import Outcome
from spark_torch.settings import resolve as resolve_settings

if TYPE_CHECKING:
    from spark_torch.driver.spark.dataframe import DataInput

__all__ = ["GroupLoop", "group_config", "group_run_id", "run_groups", "merged_result", "LOCAL_HOST"]

logger = logging.getLogger(__name__)

#: local mode: the lighthouse and every torchft listener are on loopback
LOCAL_HOST = "127.0.0.1"


def group_config(
    config: DistributorConfig, group: int, lighthouse: str, run_id: str, secret: bytes = b""
) -> DistributorConfig:
    """The options of one group's runs: its share of the ranks, the group's variables, the
    lighthouse's ``secret`` for its nodes' relays (distributed mode), its own
    run id, no restarts of its own (:class:`GroupLoop` restarts it), its own ``log_dir/group-N``
    (each group has a rank 0: one ``rank-0.log`` per group, and its Flight Recorder traces), and
    the other groups' runs as its peers (an attempt resumes from the newest checkpoint of any group)."""
    variables = GroupEnv(group, config.replica_groups, lighthouse).variables()
    return replace(
        config,
        num_processes=config.num_processes // config.replica_groups,
        replica_groups=1,
        lighthouse_options=None,
        max_restarts=0,
        env={**config.env, **variables},
        run_id=group_run_id(run_id, group),
        peer_runs=tuple(group_run_id(run_id, peer) for peer in range(config.replica_groups) if peer != group),
        log_dir=os.path.join(config.log_dir, f"group-{group}") if config.log_dir is not None else None,
        host_ranks=config.num_processes,  # local mode: every group's ranks share the driver's cores
        lighthouse_secret=secret,
    )


def _restartable(error: BaseException) -> bool:
    """A rank failed: a restart may cure it (a timeout, a bad argument or Ctrl-C may not)."""
    return isinstance(error, DistributedRunError) and not isinstance(error, RunTimeoutError)


@dataclass
class GroupLoop:
    """One replica group's attempts: a run, then a restart after each rank failure, up to
    ``budget`` restarts (-1: without limit), until it succeeds, fails for good or ``stop`` is set."""

    group: int
    config: DistributorConfig
    budget: int
    stop: threading.Event
    #: called with the group when it fails the run (the other groups are then stopped)
    on_fatal: Callable[[int | None], None]
    deadline: float | None = None
    #: stops this group's running attempt when another group fails the run (or on Ctrl-C)
    cancellation: Cancellation | None = None
    #: run_on_dataframe's DataFrame: every group stages all of it, each trains its own rows (spark_torch.rank.data)
    data: DataInput | None = None
    #: called with the group when one of its runs ended, however it ended (its ranks are gone)
    on_ended: Callable[[int], None] = lambda group: None
    #: one RunResult per attempt of this group, in order
    results: list[RunResult] = field(default_factory=list)
    value: Any = None
    error: BaseException | None = None
    succeeded: bool = False
    #: set when the loop has ended, however it ended
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def restarts(self) -> int:
        """How many times this group was restarted."""
        return max(0, len(self.results) - 1)

    def group_result(self) -> RunResult:
        """The group's own run as ``last_run.replica_groups`` shows it (and ``spark-torch runs show``
        its one call): its last ``execute``'s, with every row, attempt and restart of this group,
        from the group's start (each restart is an ``execute`` of its own; needs a result)."""
        last = self.results[-1]
        started = next((each.started for each in self.results if each.started is not None), None)
        ended = last.started + last.duration if last.started is not None and last.duration is not None else None
        attempts = [a for each in self.results for a in each.attempts]
        return replace(
            last,
            rows=[row for each in self.results for row in each.rows],
            attempts=attempts,
            restarts=restarts_of(attempts),
            started=started,
            duration=ended - started if ended is not None and started is not None else last.duration,
        )

    def run(self, spark: Any, entry: Entrypoint) -> None:
        """The loop; never raises (the outcome is in ``value``/``error``)."""
        try:
            self._loop(spark, entry)
        except BaseException as exc:  # noqa: BLE001 - the thread's end is a value the driver reads
            self.error = exc
            self.on_fatal(self.group)
        finally:
            self.done.set()

    def _loop(self, spark: Any, entry: Entrypoint) -> None:
        while True:
            config = self.config
            if self.deadline is not None:
                config = replace(config, timeout=max(0.001, self.deadline - time.monotonic()))
            record = RunRecord(run_id=str(config.run_id))
            try:
                value = execute(
                    config,
                    spark,
                    entry,
                    self.data,
                    record,
                    self.cancellation,
                    restart=bool(self.results),
                    restarts_before=len(self.results),
                )
            except BaseException as exc:  # noqa: BLE001 - decided below, per kind
                self.on_ended(self.group)
                self._keep(record)
                if self.stop.is_set():  # another group failed the run: this one only stops
                    self.error = exc
                    return
                if not _restartable(exc) or (self.budget != -1 and self.restarts >= self.budget):
                    self.error = self._fatal(exc)
                    self.on_fatal(self.group)
                    return
                logger.warning(
                    "spark_torch: replica group %d failed (%s); restarting it alone (%d of %s), the other groups go on",
                    self.group,
                    str(exc).splitlines()[0],
                    self.restarts + 1,
                    "unlimited" if self.budget == -1 else self.budget,
                )
                continue
            self.on_ended(self.group)
            self._keep(record)
            self.value, self.succeeded = value, True
            return

    def _keep(self, record: RunRecord) -> None:
        """This run of the group ended: its result (only its id when it failed before it ran)."""
        self.results.append(record.final())

    def _fatal(self, error: BaseException) -> BaseException:
        """The error this group fails the run with: a rank failure past the budget names the group."""
        if not _restartable(error):
            return error
        assert isinstance(error, DistributedRunError)
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        times = self.restarts + 1
        headline = (
            f"replica group {self.group} failed {times} time{'s' if times > 1 else ''}, more than its "
            f"max_restarts={self.budget} "
            f"allows (the other groups were stopped); its last failure: {first}. Raise max_restarts or fix the cause"
        )
        grouped = ReplicaGroupError(
            self.group, error.failures, headline, error.stacks, error.stacks_text, error.stopped
        )
        grouped.__cause__ = error.__cause__
        return grouped


def _interrupt(loops: list[GroupLoop], threads: list[threading.Thread]) -> None:
    """Ctrl-C reached the driver's main thread only: raise KeyboardInterrupt in each running
    group's thread too, so that each group's run stops its ranks as a Ctrl-C stops a run's, then
    wait for them (bounded: the nodes' grace and margin, twice). Whether a group still runs is
    its loop's ``done`` (a ``Thread.join`` that Ctrl-C interrupted may report a live thread dead)."""
    for loop, thread in zip(loops, threads):
        if thread.ident is not None and not loop.done.is_set():
            ctypes.pythonapi.PyThreadState_SetAsyncExc(
                ctypes.c_ulong(thread.ident), ctypes.py_object(KeyboardInterrupt)
            )
    deadline = time.monotonic() + 2 * DRIVER_STOP_WAIT_SECONDS
    for loop in loops:
        loop.done.wait(max(0.0, deadline - time.monotonic()))
    late = [f"replica group {loop.group}" for loop in loops if not loop.done.is_set()]
    if late:
        logger.warning(
            "spark_torch: after Ctrl-C, %s had not stopped within %.0f s", ", ".join(late), 2 * DRIVER_STOP_WAIT_SECONDS
        )


def _lighthouse_address(config: DistributorConfig, spark: Any) -> tuple[str, str]:
    """Where the lighthouse listens and the address the ranks get: loopback in local mode, the
    channel's bind and advertised addresses in distributed mode (what the executors reach)."""
    if config.local_mode or spark is None:
        return LOCAL_HOST, LOCAL_HOST
    cluster = read_cluster(spark)
    endpoint = resolve_endpoint(cluster, resolve_settings(config.given_settings(), os.environ, cluster.torch_conf))
    return endpoint.bind_host, endpoint.advertise_host


def run_groups(
    config: DistributorConfig,
    entry: Entrypoint,
    data: DataInput | None,
    spark: Any,
    keep_last: Callable[[RunResult], None],
) -> Any:
    """Run ``entry`` as ``config.replica_groups`` groups (see the module's docstring) with
    ``spark`` (the session, or None: local mode needs none); group 0's value. ``keep_last`` gets
    the whole run's result (:func:`merged_result`) before this returns or raises."""
    if data is not None and data.digest is not None:
        raise ConfigurationError(
            "run_on_dataframe with replica_groups does not take reuse_staged=True yet: each group stages the "
            "DataFrame itself; pass reuse_staged=False (docs/dataframe.md, Replica groups)"
        )
    host, advertise = _lighthouse_address(config, spark)
    distributed = not config.local_mode and spark is not None
    # distributed: the ranks reach the lighthouse through their node's relay (spark_torch.ft.node_relay),
    # which proves this secret to its gate, heard only from the cluster's addresses (a Spark Connect
    # client cannot list the executors: there from any address, the handshake still required)
    secret = new_secret() if distributed else None
    allowed = None if not distributed or is_connect_session(spark) else (lambda: executor_hosts(spark))
    run_id = config.run_id or new_run_id()
    started = time.time()
    deadline = time.monotonic() + config.timeout if config.timeout else None
    stop, lock, cancellation = threading.Event(), threading.Lock(), Cancellation()
    first: list[int | None] = []  # the group that failed the run (None: Ctrl-C)
    with (
        contextlib.ExitStack() as stack,
        Lighthouse(host, config.lighthouse_options, advertise=advertise, allowed=allowed, secret=secret) as lighthouse,
    ):

        def fail_the_run(group: int | None) -> None:
            with lock:
                if not first:
                    first.append(group)
            # the other groups' attempts are stopped now, whatever their ranks are doing (a rank
            # that never calls into torchft again would run on), and are not restarted
            stop.set()
            cancellation.cancel(
                KeyboardInterrupt() if group is None else RunCancelled(f"stopped: replica group {group} failed the run")
            )
            lighthouse.close()

        loops = [
            GroupLoop(
                g,
                group_config(config, g, lighthouse.address, run_id, secret or b""),
                config.max_restarts,
                stop,
                fail_the_run,
                deadline,
                cancellation,
                data,
                on_ended=lighthouse.retire,
            )
            for g in range(config.replica_groups)
        ]
        threads = [
            threading.Thread(
                target=loop.run, args=(spark, entry), name=f"spark-torch-replica-group-{loop.group}", daemon=True
            )
            for loop in loops
        ]
        # through the gate, which admits this user's connections from this machine
        watch = ManagerWatch(lighthouse.host, lighthouse.port, config.replica_groups).start()
        # a node's word that a group's rank ended retires the group on the lighthouse at once
        ended = {group_run_id(run_id, loop.group): functools.partial(lighthouse.retire, loop.group) for loop in loops}
        stack.enter_context(rank_ends.listening(ended))
        for thread in threads:
            thread.start()
        try:
            for loop in loops:
                loop.done.wait()
        except KeyboardInterrupt as interrupt:
            fail_the_run(None)
            _interrupt(loops, threads)
            keep_last(merged_result(run_id, loops, config, None, started, interrupt))
            raise
        finally:
            without_manager = watch.stop()  # while the lighthouse still runs
        for thread in threads:
            thread.join()  # each has set its loop's done: it is ending
    if without_manager and not first:
        _warn_without_manager(without_manager, config.replica_groups)
    failed = loops[first[0]] if first and first[0] is not None else None
    keep_last(merged_result(run_id, loops, config, failed, started))
    if first:
        assert failed is not None and failed.error is not None
        raise failed.error
    return loops[0].value


def _warn_without_manager(groups: list[int], count: int) -> None:
    """The run succeeded but these groups never made a torchft Manager: they never synced."""
    named = ", ".join(map(str, groups))
    logger.warning(
        "spark_torch: replica group%s %s never created a torchft Manager (the lighthouse never heard from %s): "
        "the %d groups trained as independent copies that did not sync. Create the Manager with "
        "spark_torch.ft.manager(...) and wrap the model and the optimizer with torchft's DistributedDataParallel "
        "and Optimizer (docs/fault-tolerance.md), or run without replica_groups",
        "s" if len(groups) > 1 else "",
        named,
        "them" if len(groups) > 1 else "it",
        count,
    )


def merged_result(
    run_id: str,
    loops: list[GroupLoop],
    config: DistributorConfig,
    failed: GroupLoop | None,
    started: float,
    interrupt: KeyboardInterrupt | None = None,
) -> RunResult:
    """The run as users see it (``last_run``): each group's own run (:meth:`GroupLoop.group_result`)
    merged by :func:`~spark_torch.driver.result.merge_groups`, the rule a past run is merged by
    too, with what only this call knows: group 0's value, the error (the failed group's, or
    Ctrl-C's ``interrupt``, whose outcome is interrupted), the failed group's outcome, and when
    the call started and ended. ``run_id`` is the run's (pass it again to resume)."""
    parts = {loop.group: loop.group_result() for loop in loops if loop.results}
    return merge_groups(
        run_id,
        parts,
        config.checkpoint_score_attribute,
        config.checkpoint_score_order,
        shown=failed.group if failed is not None and failed.results else min(parts, default=None),
        value=loops[0].value,
        error=failed.error if failed is not None else interrupt,
        outcome=Outcome.INTERRUPTED if interrupt is not None and failed is None else None,
        started=started,
        ended=time.time(),
    )
