"""What one ``run()`` call records while it runs, made into its :class:`RunResult` once, at its end.

Three parts of the driver add to a call's record as it goes: ``execute()`` (what the call runs,
when it started), the report tracker (each ``report()`` step persisted, rows dropped when an
attempt resumes from an earlier checkpoint) and the run controller (each attempt). Nothing reads
a half-made result: :meth:`RunRecord.finish` builds the call's :class:`RunResult` from the record,
its outcome and its storage, once, and the result is not changed afterwards
(:meth:`RunRecord.final`: that result, or only the run's id for a call that failed before it ran).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from spark_torch.driver.attempts import AttemptRecord
from spark_torch.driver.result import RunResult, StoredRun, restarts_of
from spark_torch.reporting.run_log import Outcome
from spark_torch.shared.staged_shards import Staging

__all__ = ["RunRecord"]


@dataclass
class RunRecord:
    """One call's records as they come (see the module docstring)."""

    run_id: str
    #: what the call runs (the function's name, or the script and its arguments)
    entry: str | None = None
    #: when the call started (Unix seconds)
    started: float | None = None
    #: the rows report() persisted in this call (rank 0's metrics with step, time, attempt, world_size)
    rows: list[dict[str, Any]] = field(default_factory=list)
    #: one record per attempt of this call
    attempts: list[AttemptRecord] = field(default_factory=list)
    #: ``reuse_staged``: how the latest attempt's DataFrame rows reached the ranks
    staging: Staging | None = None
    #: the call's result, once :meth:`finish` made it
    result: RunResult | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add_row(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        """A persisted step (from a coordinator thread); returns the rows so far."""
        with self._lock:
            self.rows.append(row)
            return list(self.rows)

    def resume_from(self, step: int) -> None:
        """An attempt resumes from the checkpoint of ``step``: the rows after it will come again."""
        with self._lock:
            self.rows[:] = [row for row in self.rows if row["step"] <= step]

    def finish(
        self, *, value: Any, error: BaseException | None, outcome: Outcome, ended: float, stored: StoredRun
    ) -> RunResult:
        """The call's :class:`RunResult`, made once from the record, how the call ended and what
        its storage says (``stored``); kept as :attr:`result`."""
        with self._lock:
            rows = list(self.rows)
        started = self.started if self.started is not None else ended
        self.result = RunResult(
            run_id=self.run_id,
            value=value,
            rows=rows,
            restarts=restarts_of(self.attempts),
            error=error,
            attempts=list(self.attempts),
            outcome=outcome,
            entry=self.entry,
            started=self.started,
            duration=ended - started,
            staging=self.staging,
            **vars(stored),
        )
        return self.result

    def final(self) -> RunResult:
        """What ``last_run`` shows of this call: the result :meth:`finish` made, or, when the
        call failed before it ran (a bad option, a function that does not pickle), only its id."""
        return self.result if self.result is not None else RunResult(run_id=self.run_id)
