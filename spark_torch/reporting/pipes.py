"""Node runner side of :func:`spark_torch.report`: gather the ranks' reports, answer them.

Each rank gets a private pair of pipes (``SPARK_TORCH_REPORT_FDS``): it writes one JSON line
per ``report()`` and blocks until the node writes the answer. Once every rank of the node has
reported step N, the node forwards one message for the node (rank 0's metrics, which ranks
passed a checkpoint, the ranks' data loaders' positions: :mod:`~spark_torch.reporting.loader_positions`) to the
driver's coordinator; when the driver has persisted step N on
every node, :meth:`NodeReports.persisted` answers every rank. Lines from a rank are only ever
parsed as JSON text.

A rank whose process ended (its report pipe closed) is told to the driver with the last step
it reported, and the steps the node's other ranks wait in (``{"ended": [[rank, step]],
"waiting": [steps]}``; again when a rank of the node reports a step after that): the
coordinator answers at once, with an error,
a step that rank can no longer report (``report()`` is a collective), instead of letting the
ranks that called it wait for ``timeout``.

A step is complete when every rank of the node reported it (the node's ranks are known up
front, so a rank that reports before another rank's pipes even exist cannot complete a step
alone). Every answer carries its step, and a step is answered once: the driver replays its
last answer to a node that reconnects, and that replay is not written to the ranks again.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Iterable
from typing import IO, Any

from spark_torch.reporting import loader_positions

__all__ = ["NodeReports"]

logger = logging.getLogger(__name__)

#: a report line longer than this is refused (rank 0's metrics, a few hundred bytes normally)
MAX_LINE = 1 << 20


class NodeReports:
    """The report pipes of one node's ranks."""

    def __init__(self, node_rank: int, ranks: Iterable[int], forward: Callable[[dict[str, Any]], None]) -> None:
        self._node = node_rank
        self._forward = forward
        self._lock = threading.Lock()
        self._answers: dict[int, IO[str]] = {}
        self._pending: dict[int, dict[int, dict[str, Any]]] = {}
        #: every rank of this node: a step is complete once all of them reported it
        self._ranks = frozenset(ranks)
        #: the last step answered (an answer for it or an earlier one is a replay)
        self._answered = 0
        #: the last step each rank reported
        self._reported: dict[int, int] = {}
        #: ranks whose process ended, with the last step each reported
        self._gone: dict[int, int] = {}
        self._threads: list[threading.Thread] = []
        self._child_fds: dict[int, tuple[int, int]] = {}

    def open(self, rank: int) -> tuple[int, int]:
        """Create the pipes of ``rank``; returns the child's (write, read) fds to pass to it."""
        if rank not in self._ranks:
            raise ValueError(f"rank {rank} is not a rank of node {self._node} ({sorted(self._ranks)})")
        report_read, report_write = os.pipe()
        answer_read, answer_write = os.pipe()
        with self._lock:
            self._answers[rank] = os.fdopen(answer_write, "w", encoding="utf-8")
            self._child_fds[rank] = (report_write, answer_read)
        thread = threading.Thread(
            target=self._read,
            args=(rank, os.fdopen(report_read, "r", encoding="utf-8")),
            name=f"spark-torch-reports-{rank}",
            daemon=True,
        )
        self._threads.append(thread)
        thread.start()
        return report_write, answer_read

    def started(self, rank: int) -> None:
        """The rank process exists: close the node's copies of its ends of the pipes."""
        with self._lock:
            fds = self._child_fds.pop(rank, ())
        for fd in fds:
            os.close(fd)

    def _read(self, rank: int, stream: IO[str]) -> None:
        with stream:
            for line in stream:
                try:
                    if len(line) > MAX_LINE:
                        raise ValueError("report line too long")
                    message = json.loads(line)
                    step = message["step"]
                    if isinstance(step, bool) or not isinstance(step, int):
                        raise ValueError("step must be an int")
                except (ValueError, KeyError, TypeError) as exc:
                    logger.warning("spark_torch: ignored a malformed report from rank %d: %s", rank, exc)
                    continue
                self._arrived(rank, step, message)
        self._ended(rank)

    def _ended(self, rank: int) -> None:
        """``rank``'s pipe closed (its process ended): tell the driver which step it reported last."""
        with self._lock:
            self._gone[rank] = self._reported.get(rank, 0)
            waiting = sorted(self._pending)
        self._tell_ended(waiting)

    def _tell_ended(self, waiting: list[int]) -> None:
        """Tell the driver which of this node's ranks ended, and the steps the others wait in."""
        with self._lock:
            ended = [[rank, last] for rank, last in sorted(self._gone.items())]
        try:
            self._forward({"node": self._node, "ended": ended, "waiting": waiting})
        except Exception as exc:  # noqa: BLE001 - the run goes on; a rank waiting in report() then waits for timeout
            logger.warning("spark_torch: could not tell the driver that ranks %s ended: %s", [r for r, _ in ended], exc)

    def _arrived(self, rank: int, step: int, message: dict[str, Any]) -> None:
        with self._lock:
            self._reported[rank] = max(step, self._reported.get(rank, 0))
            reports = self._pending.setdefault(step, {})
            reports[rank] = message
            complete = len(reports) == len(self._ranks)
            if complete:
                del self._pending[step]
            doomed = not complete and any(last < step for last in self._gone.values())
        if doomed:  # a rank of this node ended before this step: it cannot complete
            self._tell_ended([step])
        if not complete:
            return
        first = min(reports)
        message = {
            "node": self._node,
            "step": step,
            "metrics": reports[first].get("metrics") if first == 0 else None,
            "checkpoint_ranks": sorted(r for r, m in reports.items() if m.get("checkpoint")),
        }
        positions = loader_positions.by_rank(reports)
        if positions:
            message[loader_positions.KEY] = positions
        try:
            self._forward(message)
        except Exception as exc:  # noqa: BLE001 - e.g. the channel refused the message: the ranks must hear it
            logger.warning(
                "spark_torch: report step %d of node %d could not be sent to the driver: %s", step, self._node, exc
            )
            self.persisted(step, f"it could not be sent to the driver ({type(exc).__name__}: {exc})")

    def persisted(self, step: int, error: str | None = None) -> None:
        """The driver answered step ``step``: tell every rank of this node (once per step)."""
        line = json.dumps({"step": step, "error": error} if error else {"step": step}) + "\n"
        with self._lock:
            if step <= self._answered:
                return  # a replay after a reconnect: the ranks have it already
            self._answered = step
            answers = list(self._answers.values())
        for answer in answers:
            try:
                answer.write(line)
                answer.flush()
            except (OSError, ValueError):  # that rank is gone
                pass

    def close(self) -> None:
        """Close the node's ends (ranks blocked in report() see EOF and fail)."""
        with self._lock:
            answers = list(self._answers.values())
            self._answers.clear()
            child = [fd for pair in self._child_fds.values() for fd in pair]
            self._child_fds.clear()
        for answer in answers:
            try:
                answer.close()
            except OSError:
                pass
        for fd in child:
            os.close(fd)
        for thread in self._threads:
            thread.join(2.0)
