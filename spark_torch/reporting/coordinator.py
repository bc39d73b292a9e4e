"""Driver side of :func:`spark_torch.report`: once every node reported step N, persist it.

The coordinator of an attempt also notes in the run's storage that the attempt started.

Persisting step N: mark its checkpoint complete (the manifest, written after every rank's
files, with every rank's data loaders' positions), prune old checkpoints (``keep_checkpoints``), append rank 0's
metrics row to the run's
metrics log, hand the row to the live view and MLflow, then answer every node. A failure to
persist is answered as an error (``report()`` raises on every rank), not swallowed.

A rank that ended (a node says so, with the last step it reported) can report no later step:
the first step it misses is answered at once with an error naming the ranks that ended
(``report()`` is a collective every rank calls), and so is every later step a rank reports.

Persisting runs on the coordinator's own thread, in step order, never on the thread that
received the report: remote storage, pruning, MLflow or the chart may take seconds, and the
channel's connection threads must keep answering heartbeats meanwhile (a blocked one made
the node reconnect, which replayed the previous answer).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from spark_torch.reporting import loader_positions
from spark_torch.reporting.api import NOT_EVERY_RANK
from spark_torch.reporting.storage import RunStorage

__all__ = ["ReportCoordinator"]

logger = logging.getLogger(__name__)


class ReportCoordinator:
    """Collects the nodes' reports of one attempt and persists each step once."""

    def __init__(
        self,
        nodes: int,
        attempt: int,
        storage: RunStorage | None,
        on_row: Callable[[dict[str, Any]], None],
        answer: Callable[[int, str | None], None],
        keep_checkpoints: int | None = None,
        score: tuple[str | None, str] = (None, "max"),
        world_size: int = 0,
        after_checkpoint: Callable[[int], None] | None = None,
    ) -> None:
        self._nodes = nodes
        self._attempt = attempt
        self._storage = storage
        self._on_row = on_row
        self._answer = answer
        self._keep = keep_checkpoints
        self._score = score
        self._world_size = world_size
        #: called after a step with a checkpoint was persisted and answered (elastic growth)
        self._after_checkpoint = after_checkpoint
        self._lock = threading.Lock()
        self._pending: dict[int, dict[int, dict[str, Any]]] = {}
        #: the last step answered (replayed to a node that reconnects)
        self.last_answer: tuple[int, str | None] | None = None
        #: ranks that ended, with the last step each reported
        self._ended: dict[int, int] = {}
        #: steps answered with an error because a rank ended before it
        self._doomed: set[int] = set()
        #: complete steps waiting to be persisted (or a doomed step's error), in order; None ends the thread
        self._steps: queue.Queue[tuple[int, dict[int, dict[str, Any]] | str] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._persist_loop, name="spark-torch-report-persist", daemon=True)
        self._thread.start()
        if storage is not None:  # the run's record of its attempts (``spark-torch runs``)
            try:
                storage.record_attempt(attempt, world_size, nodes, *score)
            except Exception as exc:  # noqa: BLE001 - a missing line in a listing must not stop training
                logger.warning("spark_torch: could not record attempt %d in %s: %s", attempt, storage.url, exc)

    def node_report(self, node: int, report: Any) -> None:
        """A node's report of one step, or of ranks that ended (from the channel or the local
        node runner)."""
        if not isinstance(report, dict):
            raise ValueError("a report must be an object")
        if "ended" in report:
            self._ranks_ended(report["ended"], report.get("waiting", []))
            return
        step, metrics, ranks = report.get("step"), report.get("metrics"), report.get("checkpoint_ranks", [])
        if isinstance(step, bool) or not isinstance(step, int) or step < 1:
            raise ValueError("a report needs a positive int step")
        if metrics is not None and not isinstance(metrics, dict):
            raise ValueError("report metrics must be an object")
        if not isinstance(ranks, list) or not all(isinstance(r, int) for r in ranks):
            raise ValueError("checkpoint_ranks must be a list of ints")
        positions = loader_positions.checked(report.get(loader_positions.KEY))
        with self._lock:
            reports = self._pending.setdefault(step, {})
            reports[node] = {"metrics": metrics, "checkpoint_ranks": ranks, "loaders": positions}
            if self._doom(step):
                return
            if len(reports) < self._nodes:
                return
            del self._pending[step]
        self._steps.put((step, reports))

    def _ranks_ended(self, ended: Any, waiting: Any) -> None:
        """Ranks that ended (``[rank, last step]`` pairs) and the steps a node's other ranks
        wait in: a step that can no longer complete is answered with its error."""
        if not isinstance(ended, list) or not all(
            isinstance(pair, list) and len(pair) == 2 and all(type(x) is int for x in pair) for pair in ended
        ):
            raise ValueError("ended must be a list of [rank, last step] pairs")
        if not isinstance(waiting, list) or not all(type(step) is int for step in waiting):
            raise ValueError("waiting must be a list of steps")
        with self._lock:
            self._ended.update({rank: last for rank, last in ended})
            for step in sorted(set(self._pending) | set(waiting)):
                self._doom(step)

    def _doom(self, step: int) -> bool:
        """Under the lock: whether ``step`` can no longer complete (a rank ended before it); its
        error answer is queued once."""
        missing = sorted(rank for rank, last in self._ended.items() if last < step)
        if not missing:
            return False
        if step not in self._doomed:
            self._doomed.add(step)
            self._pending.pop(step, None)
            ranks = ", ".join(map(str, missing))
            self._steps.put(
                (
                    step,
                    (
                        f"{NOT_EVERY_RANK}, the same number of times: rank(s) {ranks} ended without calling it "
                        f"for step {step} (after step {min(self._ended[r] for r in missing)}). Call report() on "
                        "every rank (pass checkpoint= only on the ranks that have files to save), not under "
                        "`if rank == 0:`"
                    ),
                )
            )
        return True

    def _persist_loop(self) -> None:
        while (item := self._steps.get()) is not None:
            step, reports = item
            if isinstance(reports, str):  # a doomed step: its error, in step order
                with self._lock:
                    self.last_answer = (step, reports)
                self._answer(step, reports)
            else:
                self._persist(step, reports)

    def close(self, timeout: float = 30.0) -> None:
        """Persist the steps already complete (bounded), then end the persisting thread."""
        self._steps.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning(
                "spark_torch: persisting report() steps took over %gs; it goes on in the background", timeout
            )

    def _persist(self, step: int, reports: dict[int, dict[str, Any]]) -> None:
        error = None
        ranks: list[int] = []
        try:
            metrics: dict[str, Any] = next(
                (rep["metrics"] for rep in reports.values() if rep["metrics"] is not None), {}
            )
            row = {
                **metrics,
                "step": step,
                "time": time.time(),
                "attempt": self._attempt,
                "world_size": self._world_size,
            }
            ranks = sorted(r for rep in reports.values() for r in rep["checkpoint_ranks"])
            if ranks:
                if self._storage is None:  # pragma: no cover - the ranks refuse first
                    raise RuntimeError("this run has no storage for checkpoints")
                positions = {rank: p for rep in reports.values() for rank, p in rep.get("loaders", {}).items()}
                self._storage.complete(step, self._attempt, ranks, metrics=row, loaders=positions)
                if self._keep:
                    self._storage.prune(self._keep, *self._score)
            if self._storage is not None:
                self._storage.append_metrics(row)
            self._on_row(row)
        except Exception as exc:  # noqa: BLE001 - every rank hears about it
            logger.warning("spark_torch: report step %d could not be persisted: %s", step, exc)
            error = f"{type(exc).__name__}: {exc}"
        with self._lock:
            self.last_answer = (step, error)
        self._answer(step, error)
        if error is None and ranks and self._after_checkpoint is not None:
            self._after_checkpoint(step)
