"""The live chart's figure (driver/console/tracker.py): one panel per metric, steps on integer ticks."""

from __future__ import annotations

import pytest

from spark_torch.driver.console.tracker import chart_figure

pytest.importorskip("matplotlib")


def test_steps_are_integer_ticks() -> None:
    """A resumed run's few steps (9, 10, 11) get ticks at whole steps, never at 9.5."""
    rows = [
        {"step": step, "time": 0.0, "attempt": 2, "world_size": 2, "loss": 1.0 / step, "acc": 0.5}
        for step in (9, 10, 11)
    ]
    fig = chart_figure(rows)
    assert [ax.get_title() for ax in fig.axes] == ["acc", "loss"]  # numeric metrics only, not what spark_torch records
    for ax in fig.axes:
        low, high = ax.get_xlim()
        ticks = [t for t in ax.get_xticks() if low <= t <= high]
        assert ticks and all(float(t).is_integer() for t in ticks), ticks


def test_no_metric_no_figure() -> None:
    assert chart_figure([{"step": 1, "time": 0.0, "attempt": 0, "world_size": 1, "note": "text"}]) is None
