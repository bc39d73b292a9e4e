"""What each ``run()`` call of a run ran and how it and its attempts ended: the run's log
(``STORAGE/RUN_ID/run.jsonl``, written by the driver only), its rows and the records read back
from it (:class:`CallRecord`, :class:`AttemptEndRow`), and the retention of runs that reported
nothing. ``spark-torch runs``, :func:`spark_torch.list_runs` and ``RunResult.from_path`` read it.

One row per event, each with ``event`` and ``time`` (Unix seconds)::

    {"event": "call", "entry": "train", "kind": "function", ...}      a run() call started
    {"event": "attempt", "attempt": 0, "end": "failed", ...}          one of its attempts ended
    {"event": "end", "outcome": "failed", "error": "...", ...}        the call ended

A call without an ``end`` row is still running, or its driver died first (``outcome`` "no end
recorded").
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from spark_torch.base.states import ValueEnum
from spark_torch.reporting.storage import RUN_LOG, RunStorage, run_ids

__all__ = [
    "Outcome",
    "AttemptEndRow",
    "CallRecord",
    "KEEP_UNREPORTED_RUNS",
    "call_row",
    "attempt_row",
    "attempt_line",
    "end_row",
    "read_calls",
    "prune_unreported",
]

logger = logging.getLogger(__name__)

#: how many runs that reported nothing (no metrics, no checkpoint) the default storage keeps;
#: older ones are removed when a run there ends (docs/cli.md)
KEEP_UNREPORTED_RUNS = 100


class Outcome(ValueEnum):
    """How a ``run()`` call ended."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    TIMED_OUT = "stopped by timeout"
    STALLED = "stopped by a stall"
    INTERRUPTED = "stopped by Ctrl-C"
    #: no end row: the call still runs, or its driver ended first
    NO_END = "no end recorded"


@dataclass(frozen=True)
class AttemptEndRow:
    """One attempt's end, as the run's log keeps it (plain values: the driver's
    ``AttemptRecord`` rebuilt from it by ``RunResult.from_path``)."""

    attempt: int
    world_size: int
    nodes: int
    reason: str
    end: str
    error_type: str | None = None
    error: str | None = None
    size: str = ""
    time: float | None = None
    #: why an attempt that ended to grow did (elastic_grow)
    detail: str | None = None

    def __str__(self) -> str:
        return attempt_line(
            self.attempt, self.world_size, self.nodes, self.reason, self.size, self.end, self.error or self.detail
        )


def attempt_line(
    attempt: int, world_size: int, nodes: int, reason: str, size: str, end: str | None, detail: str | None
) -> str:
    """An attempt in one line, the one spelling of ``spark-torch runs`` and ``AttemptRecord``:
    ``attempt 1: 4 rank(s) on 2 node(s), restart (why its size); how it ended: its error``."""
    text = f"attempt {attempt}: {world_size} rank(s) on {nodes} node(s), {reason}"
    if size:
        text += f" ({size})"
    if end:
        text += f"; {end}"
    return text + (f": {detail}" if detail else "")


@dataclass(frozen=True)
class CallRecord:
    """One ``run()`` call of a run.

    Attributes:
        entry: what it ran: the function's name, or the script and its arguments.
        kind: ``"function"`` or ``"script"``.
        started: when it started (Unix seconds).
        ended: when it ended, or None (no end row).
        outcome: how it ended (:class:`Outcome`).
        error: the error's type and first line when it failed or was stopped, else None.
        attempts: each attempt's end, oldest first.
    """

    entry: str
    kind: str
    started: float
    ended: float | None = None
    outcome: Outcome = Outcome.NO_END
    error: str | None = None
    attempts: tuple[AttemptEndRow, ...] = field(default_factory=tuple)

    @property
    def duration(self) -> float | None:
        """Seconds from start to end (None without an end)."""
        return None if self.ended is None else max(0.0, self.ended - self.started)


def _clip(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def call_row(entry: str, kind: str, argv: Sequence[str] = (), *, started: float) -> dict[str, Any]:
    """The row of a call's start: the function's name, or the script with its arguments."""
    shown = " ".join([entry, *argv]) if kind == "script" else entry
    return {"event": "call", "time": started, "entry": _clip(shown, 1000), "kind": kind}


def attempt_row(
    attempt: int,
    world_size: int,
    nodes: int,
    reason: str,
    end: str,
    error: tuple[str, str] | None,
    size: str,
    when: float,
) -> dict[str, Any]:
    """The row of an attempt's end (``error``: its type's name and first line)."""
    row: dict[str, Any] = {
        "event": "attempt",
        "time": when,
        "attempt": attempt,
        "world_size": world_size,
        "nodes": nodes,
    }
    row.update(reason=reason, end=end, size=size)
    if error is not None:
        row.update(error_type=error[0], error=_clip(error[1] or error[0]))
    return row


def end_row(outcome: Outcome, error: BaseException | None, when: float) -> dict[str, Any]:
    """The row of a call's end: its outcome and, unless it succeeded, the error's first line."""
    row: dict[str, Any] = {"event": "end", "time": when, "outcome": outcome.value}
    if error is not None:
        first = (str(error).splitlines() or [""])[0]
        row["error"] = _clip(f"{type(error).__name__}: {first}" if first else type(error).__name__)
    return row


def _number(value: Any, default: float | None = None) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default


def _attempt(row: Mapping[str, Any]) -> AttemptEndRow:
    def whole(key: str) -> int:
        value = row.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) else 0

    def text(key: str) -> str | None:
        value = row.get(key)
        return value if isinstance(value, str) else None

    return AttemptEndRow(
        attempt=whole("attempt"),
        world_size=whole("world_size"),
        nodes=whole("nodes"),
        reason=text("reason") or "?",
        end=text("end") or "?",
        error_type=text("error_type"),
        error=text("error"),
        size=text("size") or "",
        time=_number(row.get("time")),
        detail=text("detail"),
    )


def read_calls(rows: Iterable[Mapping[str, Any]]) -> list[CallRecord]:
    """The calls of a run's log, oldest first (rows of an unknown kind, or before the first
    call, are skipped: a newer writer's rows never break an older reader)."""
    calls: list[CallRecord] = []
    for row in rows:
        event, when = row.get("event"), _number(row.get("time"))
        if event == "call" and when is not None:
            calls.append(CallRecord(entry=str(row.get("entry") or "?"), kind=str(row.get("kind") or "?"), started=when))
        elif calls and event == "attempt":
            last = calls[-1]
            calls[-1] = CallRecord(**{**last.__dict__, "attempts": (*last.attempts, _attempt(row))})
        elif calls and event == "end":
            try:
                outcome = Outcome(row.get("outcome"))
            except ValueError:
                outcome = Outcome.FAILED
            error = row.get("error")
            calls[-1] = CallRecord(
                **{
                    **calls[-1].__dict__,
                    "ended": when,
                    "outcome": outcome,
                    "error": error if isinstance(error, str) else None,
                }
            )
    return calls


def record(storage: RunStorage | None, row: Mapping[str, Any]) -> None:
    """Append ``row`` to the run's log; a storage that fails only warns (a missing line in a
    listing must not stop a run)."""
    if storage is None:
        return
    try:
        storage.append_log(RUN_LOG, row)
    except Exception as exc:  # noqa: BLE001 - every fsspec backend raises its own kinds
        logger.warning("spark_torch: could not record the run's %s in %s: %s", row.get("event"), storage.url, exc)


def prune_unreported(
    base: str, options: Mapping[str, Any], keep: int = KEEP_UNREPORTED_RUNS, spare: str | None = None
) -> list[str]:
    """Remove the runs under the storage ``base`` (opened with ``options``, the run's own) that
    reported nothing (their directory holds only the run's marker and logs) and whose last call
    ended, beyond the newest ``keep`` of them; ``spare`` (the run that just ended) is never
    removed. Returns the ids removed."""
    ended: list[tuple[float, str]] = []
    for run_id in run_ids(base, options):
        if run_id == spare:
            continue
        storage = RunStorage(base, run_id, options)
        with contextlib.suppress(OSError):
            if not storage.holds_only_logs():  # reported or checkpointed: kept (one listing, no metrics read)
                continue
            calls = read_calls(storage.read_log(RUN_LOG))
            if calls and calls[-1].ended is not None:
                ended.append((calls[-1].started, run_id))
    removed = []
    for _started, run_id in sorted(ended, reverse=True)[max(0, keep - (spare is not None)) :]:
        if RunStorage(base, run_id, options).remove_if_unused():
            removed.append(run_id)
    return removed
