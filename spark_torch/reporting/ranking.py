"""Which of a run's checkpoints are best: the checkpoint record, the order by a reported metric,
and the score a past run was configured with (pure; no filesystem)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["CheckpointInfo", "best", "recorded_score"]


@dataclass(frozen=True)
class CheckpointInfo:
    """A complete checkpoint: its step, where it is, and the metrics reported with it."""

    step: int
    url: str
    attempt: int = 0
    metrics: dict[str, Any] = field(default_factory=dict)


def _score(checkpoint: CheckpointInfo, score: str) -> float | None:
    value = checkpoint.metrics.get(score)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def best(checkpoints: list[CheckpointInfo], score: str | None, order: str = "max") -> list[CheckpointInfo]:
    """``checkpoints`` best first by the metric ``score`` (``order`` "max" or "min"; the ones
    without it last, newest first); without ``score``: newest first."""
    if not score:
        return sorted(checkpoints, key=lambda c: -c.step)
    sign = -1.0 if order == "max" else 1.0

    def key(c: CheckpointInfo) -> tuple[int, float, int]:
        value = _score(c, score)
        return (1, 0.0, -c.step) if value is None else (0, sign * value, -c.step)

    return sorted(checkpoints, key=key)


def recorded_score(
    attempts: list[dict[str, Any]], attribute: str | None = None, order: str | None = None
) -> tuple[str | None, str]:
    """The checkpoint score to order a past run's checkpoints by: ``attribute``/``order`` when
    given, else what its latest attempt was configured with (its ``attempts`` row); no score
    (latest first) for a run configured without one."""
    latest = attempts[-1] if attempts else {}
    stored = latest.get("checkpoint_score_attribute")
    stored = stored if isinstance(stored, str) and stored else None
    chosen = attribute if attribute is not None else stored
    stored_order = latest.get("checkpoint_score_order") if chosen == stored else None
    return chosen, order or (stored_order if stored_order in ("max", "min") else "max")
