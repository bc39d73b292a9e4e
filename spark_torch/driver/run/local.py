"""Local mode: every rank on the driver machine, the one node's runner in this process.

The node runner (:func:`~spark_torch.node.lifecycle.run_node`) gets a :class:`LocalIO`: the
rendezvous is this node alone, rank output goes straight to the driver's sink, report() steps
straight to the attempt's coordinator, and the timeout is a timer on the node's stop event.
"""

from __future__ import annotations

import socket
import threading
from contextlib import nullcontext
from dataclasses import replace
from typing import Any

from spark_torch.base.states import ShardSource, StopReason, StopSignal
from spark_torch.driver.run.attempt import Attempt
from spark_torch.driver.run.classify import AttemptEvidence, TimeUp, Verdict, classify
from spark_torch.driver.run.outcome import AttemptOutcome, Interrupted
from spark_torch.driver.run.stall import note_stacks
from spark_torch.driver.spark.dataframe import DataInput
from spark_torch.driver.spark.pyspark_shims import collect_arrow
from spark_torch.driver.spark.staged_reuse import KeptRows
from spark_torch.errors import RankFailure
from spark_torch.ft.rank_ends import rank_ended
from spark_torch.node.lifecycle import NodeProblem, NodeResult, run_node
from spark_torch.node.progress import ProgressWatch
from spark_torch.node.workdir import NodeWorkdir
from spark_torch.reporting.coordinator import ReportCoordinator
from spark_torch.reporting.pipes import NodeReports
from spark_torch.shared.lines import RankOutput
from spark_torch.shared.rank_files import map_file

__all__ = ["run_local", "LocalIO", "LOCAL_HOST"]

LOCAL_HOST = "127.0.0.1"


class LocalIO:
    """The one node of a local-mode run (see :class:`~spark_torch.node.lifecycle.NodeIO`)."""

    node_rank = 0
    master_host = LOCAL_HOST

    def __init__(self, attempt: Attempt) -> None:
        self.attempt = attempt
        self.host = socket.gethostname()
        self.stop = StopSignal()
        #: the node's progress watch, once the ranks started (it answers the stall watch's trace requests)
        self._progress: ProgressWatch | None = None
        self.stall = attempt.stall_watch(stop=self.stop_ranks, request_traces=self._request_traces)
        #: this attempt's report() coordinator, once the ranks' pipes exist
        self.coordinator: ReportCoordinator | None = None
        #: the run's timeout passed (the timer stopped the ranks)
        self.time_up = False

    def rendezvous(self, hello: dict[str, Any]) -> list[dict[str, Any]]:
        return [{**hello, "node": 0}]

    def output(self) -> RankOutput:
        return self.attempt.on_lines

    def task_gpus(self) -> list[str]:  # pragma: no cover - a local plan names its GPUs
        return []

    def report_pipes(self, ranks: range) -> NodeReports:
        # the node runner is on the driver: its reports go straight to the coordinator
        reports = NodeReports(0, ranks, forward=lambda report: coordinator.node_report(0, report))
        coordinator = self.coordinator = self.attempt.report_coordinator(answer=reports.persisted)
        return reports

    def progress(self, stacks: list[dict[str, Any]]) -> None:
        self.stall.update(0, stacks)

    def trace(self, rank: int, data: bytes) -> None:
        self.stall.trace(rank, data)

    def watching(self, watch: ProgressWatch) -> None:
        self._progress = watch

    def _request_traces(self, stopping: bool) -> None:
        if self._progress is not None:
            self._progress.request_traces(stopping)

    def stop_ranks(self, reason: StopReason) -> None:
        """Stop this attempt's ranks (the first reason given is the one kept, and the node's
        result says it)."""
        self.stop.request(reason)

    def time_is_up(self) -> None:
        """``timeout``: keep where the ranks are, then stop them."""
        self.stall.freeze()
        self.time_up = True
        self.stop_ranks(StopReason.TIMEOUT)

    def verdict(self, hosted: NodeResult | None) -> Verdict:
        """What the driver did to the attempt: a cancellation from another thread, a stall, the
        timeout (in the order they are checked), or nothing."""
        cancellation = self.attempt.cancellation
        if cancellation is not None and cancellation.error is not None:
            return Interrupted(cancellation.error)
        if self.stall.failed.is_set():
            return self.stall.verdict()
        if not self.time_up:
            return None
        group = hosted.group if hosted is not None else None
        lines = {status.rank: status.last_lines for status in group.ranks} if group is not None else {}
        every_rank = {0: range(self.attempt.spec.plan.world_size)}
        return TimeUp(
            self.attempt.run_timeout, every_rank, lambda rank: lines.get(rank, ()), self.stall.stacks(), host=self.host
        )

    def rank_failed(self, failure: RankFailure, pickled: str | None) -> None:
        """The driver is right here (the node's outcome carries the failure); a replica group's
        lighthouse hears it at once (:mod:`spark_torch.ft.rank_ends`)."""
        rank_ended(self.attempt.spec.run_id)


def run_local(attempt: Attempt, data: DataInput | None = None) -> AttemptOutcome:
    """Run all ranks here; every way the attempt ends is returned: succeeded with rank 0's
    pickled result (function mode) or None, else the typed cause. With ``reuse_staged`` the
    rows a previous run kept are used when they are still there (else staged again)."""
    if data is None or data.digest is None:
        return _run_here(attempt, data)
    spec = attempt.spec
    assert spec.data is not None
    kept = KeptRows.for_attempt(data.df.sparkSession, data.digest, data.columns, data.explicit, spec.plan)
    cache, missed = kept.first(), False
    while True:
        here = replace(attempt, spec=replace(spec, data=replace(spec.data, cache=cache)))
        outcome = _run_here(here, None if cache.reuse else data)
        use = outcome.shards.get(0)
        if use is not None and use.source is ShardSource.MISSED and cache.reuse:
            cache, missed = kept.missed(cache), True
            continue
        return replace(outcome, staging=kept.settle(cache, outcome.shards, 1, missed))


def _run_here(attempt: Attempt, data: DataInput | None) -> AttemptOutcome:
    """One node runner here (``data``: the DataFrame to read; None: nothing to read); how the
    attempt ended (with the node's outcome: where its rows came from)."""
    spec = attempt.spec
    io = LocalIO(attempt)
    # local mode: the driver reads the DataFrame and the ranks split its rows
    batches = collect_arrow(data.df.select(*data.columns)).to_batches() if data is not None else None
    timer = threading.Timer(attempt.timeout, io.time_is_up) if attempt.timeout else None
    with NodeWorkdir(spec.run_id, 0) as workdir:
        if timer is not None:
            timer.daemon = True
            timer.start()
        cancellation = attempt.cancellation
        hosted: NodeResult | None = None
        try:
            with (
                cancellation.watch(lambda: io.stop_ranks(StopReason.CANCELLED))
                if cancellation is not None
                else nullcontext()
            ):
                hosted = run_node(spec, io, workdir, batches)
            outcome = hosted.outcome()
        except KeyboardInterrupt as interrupt:
            note_stacks(interrupt, io.stall)
            return classify(AttemptEvidence(nodes=1, verdict=Interrupted(interrupt)))
        except NodeProblem as problem:
            outcome = problem.outcome()
        finally:
            if timer is not None:
                timer.cancel()
            if io.coordinator is not None:
                io.coordinator.close()
            io.stall.close()
        group = hosted.group if hosted is not None else None
        result_file = group.result_file if group is not None else None
        return classify(
            AttemptEvidence(
                nodes=1,
                outcomes={0: outcome},
                verdict=io.verdict(hosted),
                # readable after the workdir is removed
                result=lambda: map_file(result_file) if result_file is not None else None,
            )
        )
