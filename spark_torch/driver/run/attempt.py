"""One attempt of a run on the driver: the run spec plus what only the driver needs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from spark_torch.base.states import StopReason
from spark_torch.driver.run.cancel import Cancellation
from spark_torch.driver.run.flight_recorder import TraceDir
from spark_torch.driver.run.membership import Membership
from spark_torch.driver.run.stall import StallWatch
from spark_torch.reporting.coordinator import ReportCoordinator
from spark_torch.reporting.storage import RunStorage
from spark_torch.shared.lines import RankOutput
from spark_torch.shared.spec import RunSpec

__all__ = ["Attempt"]


@dataclass(frozen=True)
class Attempt:
    """One (re)start of the whole gang. ``spec.run_id`` is stable across restarts.

    Two counts, each with one name: ``attempt`` is this attempt's index in the run's history
    (``AttemptRecord.attempt``, the report() rows' ``attempt``; it counts on across ``run()``
    calls that resume a run_id), ``spec.restart_count`` the restarts within this ``run()`` call
    (``RunResult.restarts``; the ranks' ``SPARK_TORCH_RESTART_COUNT``)."""

    spec: RunSpec
    on_lines: RankOutput = field(repr=False)
    #: this attempt's index in the run's history (0 for the run's first start)
    attempt: int = 0
    timeout: float | None = None  # what is left of the run's time for this attempt
    run_timeout: float | None = None  # the user's ``timeout``, for messages
    #: the last lines the driver received from a rank (for errors about ranks that did not report)
    tail: Callable[[int], tuple[str, ...]] = field(default=lambda rank: (), repr=False)
    #: receives rank 0's metrics row of every persisted report() step
    on_row: Callable[[dict[str, Any]], None] = field(default=lambda row: None, repr=False)
    keep_checkpoints: int | None = None
    #: keep the best checkpoints by this reported metric (and ``score_order``) instead of the newest
    score_attribute: str | None = None
    score_order: str = "max"
    #: elastic_grow: the run's sizes (an attempt below full size watches for free slots)
    membership: Membership | None = None
    #: the status line's stall: seconds without progress, None when the run moves (again)
    on_stall: Callable[[float | None], None] = field(default=lambda idle: None, repr=False)
    #: where the ranks' Flight Recorder traces go when a stall is found
    trace_dir: TraceDir | None = None
    #: stops this attempt from another thread (replica groups: another group failed the run, Ctrl-C)
    cancellation: Cancellation | None = field(default=None, repr=False)

    def stall_watch(
        self, stop: Callable[[StopReason], None], request_traces: Callable[[bool], None] | None = None
    ) -> StallWatch:
        """This attempt's stall detector (inactive with ``stall_timeout=0``); ``stop`` stops the
        attempt when ``stall_action="fail"``, ``request_traces`` asks the nodes for the ranks'
        Flight Recorder traces (True: the ranks are about to be stopped)."""
        settings = self.spec.settings
        return StallWatch(
            self.spec.world_size,
            settings.stall_timeout,
            settings.stall_action,
            stop=stop,
            on_status=self.on_stall,
            trace_dir=self.trace_dir,
            request_traces=request_traces,
        )

    def report_coordinator(
        self, answer: Callable[[int, str | None], None], after_checkpoint: Callable[[int], None] | None = None
    ) -> ReportCoordinator:
        """The coordinator of this attempt's report() steps; ``answer`` tells the nodes."""
        store = self.spec.storage
        storage = RunStorage(store.base, self.spec.run_id, store.options) if store is not None else None
        return ReportCoordinator(
            nodes=self.spec.plan.num_nodes,
            attempt=self.attempt,
            storage=storage,
            on_row=self.on_row,
            answer=answer,
            keep_checkpoints=self.keep_checkpoints,
            score=(self.score_attribute, self.score_order),
            world_size=self.spec.world_size,
            after_checkpoint=after_checkpoint,
        )

    @property
    def tag(self) -> str:
        """Spark job tag of this attempt (unique per run and attempt)."""
        return f"spark-torch-{self.spec.run_id}-{self.attempt}"
