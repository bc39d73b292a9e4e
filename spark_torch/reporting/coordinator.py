"""Driver side of :func:`spark_torch.report`: once every node reported step N, persist it.

The coordinator of an attempt also notes in the run's storage that the attempt started.

Persisting step N: mark its checkpoint complete (the manifest, written after every rank's
files), prune old checkpoints (``keep_checkpoints``), append rank 0's metrics row to the run's
metrics log, hand the row to the live view and MLflow, then answer every node. A failure to
persist is answered as an error (``report()`` raises on every rank), not swallowed.

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
        #: complete steps waiting to be persisted, in order; None ends the thread
        self._steps: queue.Queue[tuple[int, dict[int, dict[str, Any]]] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._persist_loop, name="spark-torch-report-persist", daemon=True)
        self._thread.start()
        if storage is not None:  # the run's record of its attempts (``spark-torch runs``)
            try:
                storage.record_attempt(attempt, world_size, nodes)
            except Exception as exc:  # noqa: BLE001 - a missing line in a listing must not stop training
                logger.warning("spark_torch: could not record attempt %d in %s: %s", attempt, storage.url, exc)

    def node_report(self, node: int, report: Any) -> None:
        """A node's report of one step (from the channel or the local node runner)."""
        if not isinstance(report, dict):
            raise ValueError("a report must be an object")
        step, metrics, ranks = report.get("step"), report.get("metrics"), report.get("checkpoint_ranks", [])
        if isinstance(step, bool) or not isinstance(step, int) or step < 1:
            raise ValueError("a report needs a positive int step")
        if metrics is not None and not isinstance(metrics, dict):
            raise ValueError("report metrics must be an object")
        if not isinstance(ranks, list) or not all(isinstance(r, int) for r in ranks):
            raise ValueError("checkpoint_ranks must be a list of ints")
        with self._lock:
            reports = self._pending.setdefault(step, {})
            reports[node] = {"metrics": metrics, "checkpoint_ranks": ranks}
            if len(reports) < self._nodes:
                return
            del self._pending[step]
        self._steps.put((step, reports))

    def _persist_loop(self) -> None:
        while (item := self._steps.get()) is not None:
            self._persist(*item)

    def close(self, timeout: float = 30.0) -> None:
        """Persist the steps already complete (bounded), then end the persisting thread."""
        self._steps.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("spark_torch: persisting report() steps took over %gs; it goes on in the background", timeout)

    def _persist(self, step: int, reports: dict[int, dict[str, Any]]) -> None:
        error = None
        ranks: list[int] = []
        try:
            metrics: dict[str, Any] = next((rep["metrics"] for rep in reports.values() if rep["metrics"] is not None), {})
            row = {**metrics, "step": step, "time": time.time(), "attempt": self._attempt, "world_size": self._world_size}
            ranks = sorted(r for rep in reports.values() for r in rep["checkpoint_ranks"])
            if ranks:
                if self._storage is None:  # pragma: no cover - the ranks refuse first
                    raise RuntimeError("this run has no storage for checkpoints")
                self._storage.complete(step, self._attempt, ranks, metrics=row)
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
