"""What the channel hands its messages to: protocols, so that it imports none of the driver,
node or reporting classes that implement them.

Rank output goes to a :class:`spark_torch.shared.lines.RankOutput` on both ends.
"""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["StepSink", "StepAnswers", "BulkSink"]


class StepSink(Protocol):
    """Driver side of report(): takes each node's report of a step
    (:class:`~spark_torch.reporting.coordinator.ReportCoordinator`)."""

    #: the last step answered, and its error (replayed to a node that reconnects)
    last_answer: tuple[int, str | None] | None

    def node_report(self, node: int, report: Any) -> None:
        """A node's report of one step; raises ValueError when malformed."""


class StepAnswers(Protocol):
    """Node side of report(): where the driver's answers go (:class:`~spark_torch.reporting.pipes.NodeReports`)."""

    def persisted(self, step: int, error: str | None = None) -> None:
        """Step ``step`` is persisted on every node (or failed with ``error``)."""


class BulkSink(Protocol):
    """Driver side of a node's bulk data, e.g. rank 0's result
    (:class:`~spark_torch.node.result_transfer.StreamedResult`)."""

    def piece(self, node: int, header: Any, data: Any) -> None:
        """One piece (authenticated, in order, exactly once); raises ValueError when unexpected,
        OSError when it cannot be stored. Whatever it raises, the node is told and its stream
        fails (its ``send_bulk``/``drain``), and the node's later pieces are not handed on."""
