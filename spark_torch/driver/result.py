"""What one ``Distributor.run()`` produced: :class:`RunResult` (``distributor.last_run``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["RunResult"]


@dataclass
class RunResult:
    """The outcome of the latest ``run()``/``run_on_dataframe()`` call.

    Attributes:
        value: rank 0's return value (what ``run()`` returned; None for scripts or failures).
        rows: one dict per persisted ``report()`` step of this call: rank 0's metrics plus
            ``step``, ``time`` (Unix seconds) and ``attempt`` (0, then 1 after the first restart).
        checkpoint: the latest complete checkpoint (path or URL), or None.
        run_id: the run's id (pass it again as ``run_id=`` to resume from its checkpoint).
        restarts: how many times the gang was restarted.
        error: the exception when the run failed (``run()`` raised it too).
    """

    run_id: str
    value: Any = None
    rows: list[dict[str, Any]] = field(default_factory=list)
    checkpoint: str | None = None
    restarts: int = 0
    error: BaseException | None = None

    @property
    def metrics(self) -> Any:
        """``rows`` as a pandas DataFrame (columns: the reported keys, ``step``, ``time``, ``attempt``)."""
        try:
            import pandas as pd
        except ImportError as exc:  # pragma: no cover - pandas comes with the spark extra
            raise ImportError("RunResult.metrics needs pandas (pip install pandas); RunResult.rows has the same data") from exc
        columns = ["step", "time", "attempt"]
        frame = pd.DataFrame(self.rows)
        if frame.empty:
            return pd.DataFrame(columns=columns)
        ordered = [c for c in frame.columns if c not in columns] + columns
        return frame[ordered].sort_values("step", kind="stable").reset_index(drop=True)
