"""The runs a storage holds (:func:`list_runs`, ``spark-torch runs``): one :class:`RunSummary`
per run, read from what its storage records (the attempt log, the metrics log, the
checkpoints), and the text the command prints for them."""

from __future__ import annotations

import json
import os
import time
import warnings
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from spark_torch.driver.group_runs import group_of
from spark_torch.driver.result import RunResult
from spark_torch.reporting.api import RECORDED_KEYS
from spark_torch.reporting.checkpoint import Checkpoint, persisted_checkpoint
from spark_torch.reporting.ranking import best, recorded_score
from spark_torch.reporting.run_log import CallRecord, Outcome, read_calls
from spark_torch.reporting.storage import DEFAULT_STORAGE, RUN_LOG, RunStorage, run_ids
from spark_torch.reporting.storage_keys import remember

__all__ = ["RunSummary", "list_runs", "read_summary", "runs_table", "run_details", "summary_json", "load_run"]


@dataclass(frozen=True)
class RunSummary:
    """One past run, as :func:`list_runs` and ``spark-torch runs`` show it (read from its storage).

    Attributes:
        run_id: the run's id.
        path: the run's directory (``RunResult.from_path(path)`` opens it whole).
        started: when its first attempt started (Unix seconds); for runs whose storage holds no
            attempt log, the time of the first reported step; None when neither is there.
        attempts: the attempts started, over every ``run()`` call with this ``run_id``
            (restarts included); None when the storage holds no attempt log.
        world_size: the ranks of the latest attempt (None: unknown).
        steps: the steps reported.
        metrics: the last reported metrics (with ``step``, ``time``, ``attempt``, ``world_size``).
        checkpoint: the latest complete checkpoint, or None.
        best_checkpoint: the best kept checkpoint by ``checkpoint_score_attribute`` (without
            one: the latest), or None.
        attempt_log: one dict per attempt started, oldest first: ``attempt`` (its index in the
            run's history: 0 for the run's first start, counting on across restarts and the
            ``run()`` calls that resume the run), ``world_size``, ``nodes``, ``time`` (and
            ``checkpoint_score_attribute``/``checkpoint_score_order`` when it had one).
        checkpoint_score_attribute: the metric ``best_checkpoint`` is chosen by: the one given
            to :func:`list_runs`, else the one the run was configured with; None: the latest.
        checkpoint_score_order: ``"max"`` (highest is best) or ``"min"``.
        outcome: how its latest ``run()`` call ended (:class:`~spark_torch.reporting.run_log.Outcome`:
            succeeded, failed, stopped by timeout, by a stall or by Ctrl-C; "no end recorded"
            while it runs or when its driver died); None for a run without a run log (older
            versions).
        error: the latest call's error, its type and first line (None when it succeeded).
        entry: what the latest call ran: the function's name, or the script and its arguments.
        duration: how long the latest call took, in seconds (None without an end).
        calls: every ``run()`` call with this ``run_id``, oldest first, each with its attempts'
            ends and reasons (:class:`~spark_torch.reporting.run_log.CallRecord`).
        replica_run: for one replica group's run (``replica_groups``: each group stores its own
            run, ``RUN_ID-g0``, ``RUN_ID-g1``...), the whole run's ``RUN_ID``
            (``RunResult.from_path(storage, RUN_ID)`` and ``spark-torch runs show RUN_ID`` open it
            whole); None for other runs.
        replica_group: that group's index (None for other runs).
    """

    run_id: str
    path: str
    started: float | None
    attempts: int | None
    world_size: int | None
    steps: int
    metrics: dict[str, Any]
    checkpoint: Checkpoint | None
    best_checkpoint: Checkpoint | None
    attempt_log: list[dict[str, Any]] = field(default_factory=list)
    checkpoint_score_attribute: str | None = None
    checkpoint_score_order: str = "max"
    outcome: Outcome | None = None
    error: str | None = None
    entry: str | None = None
    duration: float | None = None
    calls: list[CallRecord] = field(default_factory=list)
    replica_run: str | None = None
    replica_group: int | None = None


def read_summary(storage: RunStorage, score: str | None = None, order: str | None = None) -> RunSummary:
    """The summary of the run in ``storage``; ``score``/``order`` choose its best checkpoint
    (default: the score the run was configured with, stored with it)."""
    history = storage.history()
    log = storage.attempts()
    score, order = recorded_score(log, score, order)
    complete, _ = storage.checkpoints()
    ranked = best(complete, score, order)
    last = dict(history[-1]) if history else {}
    calls = read_calls(storage.read_log(RUN_LOG))
    started = (
        calls[0].started if calls else log[0].get("time") if log else (history[0].get("time") if history else None)
    )
    last_call = calls[-1] if calls else None
    world_size = log[-1].get("world_size") if log else last.get("world_size")
    key = remember(storage.options)  # the checkpoints hold the key, not the options (the pickling rule)
    return RunSummary(
        run_id=storage.run_id,
        path=storage.url,
        started=float(started) if isinstance(started, (int, float)) else None,
        attempts=len(log) if log else None,
        world_size=world_size if isinstance(world_size, int) else None,
        steps=len(history),
        metrics=last,
        checkpoint=persisted_checkpoint(complete[-1], key) if complete else None,
        best_checkpoint=persisted_checkpoint(ranked[0], key) if ranked else None,
        attempt_log=log,
        checkpoint_score_attribute=score,
        checkpoint_score_order=order,
        outcome=last_call.outcome if last_call else None,
        error=last_call.error if last_call else None,
        entry=last_call.entry if last_call else None,
        duration=last_call.duration if last_call else None,
        calls=calls,
    )


def list_runs(
    storage_path: str | os.PathLike[str] | None = None,
    *,
    storage_options: dict[str, Any] | None = None,
    checkpoint_score_attribute: str | None = None,
    checkpoint_score_order: str | None = None,
) -> list[RunSummary]:
    """The runs kept under ``storage_path`` (default ``~/spark_torch_runs``), newest first, as
    :class:`RunSummary` (``spark-torch runs`` prints the same). ``checkpoint_score_attribute``
    and ``checkpoint_score_order`` choose each run's ``best_checkpoint``, as in ``Distributor``;
    by default each run's own, stored with it (what its ``last_run`` used; none: the latest).
    A storage that does not exist holds no runs."""
    base = os.fspath(storage_path) if storage_path is not None else DEFAULT_STORAGE
    stored = run_ids(base, storage_options)
    known = set(stored)
    summaries = [
        _with_group(
            read_summary(RunStorage(base, run_id, storage_options), checkpoint_score_attribute, checkpoint_score_order),
            known,
        )
        for run_id in stored
    ]
    # a replica-group run's groups stay together, group 0 first, where the whole run started
    started: dict[str, float] = {}
    for s in summaries:
        key = s.replica_run or s.run_id
        if s.started is not None:
            started[key] = min(started.get(key, s.started), s.started)

    def order(s: RunSummary) -> tuple[bool, float, str, int]:
        key = s.replica_run or s.run_id
        return (key in started, started.get(key, 0.0), key, -(s.replica_group or 0))

    return sorted(summaries, key=order, reverse=True)


def _with_group(summary: RunSummary, stored: set[str]) -> RunSummary:
    """``summary`` naming the replica-group run it is one group of (:func:`group_of`)."""
    found = group_of(summary.run_id, stored)
    return summary if found is None else replace(summary, replica_run=found[0], replica_group=found[1])


def _when(seconds: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(seconds)) if seconds is not None else "-"


def _metrics_text(metrics: dict[str, Any], limit: int | None = None) -> str:
    """``name=value`` for the reported metrics (not the recorded keys), numbers to 4 digits."""
    parts = [
        f"{key}={value:.4g}" if isinstance(value, float) else f"{key}={value}"
        for key, value in metrics.items()
        if key not in RECORDED_KEYS
    ]
    if limit is not None and len(parts) > limit:
        parts = parts[:limit] + ["..."]
    return " ".join(parts) or "-"


def _duration(seconds: float | None) -> str:
    """``42.0s``, ``4m05s``, ``2h03m``; ``-`` when unknown."""
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}m{secs:02d}s" if minutes < 60 else f"{minutes // 60}h{minutes % 60:02d}m"


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _outcome_text(outcome: Outcome | None, error: str | None, limit: int | None = None) -> str:
    """``succeeded``, ``failed: ValueError: bad lr``, ``stopped by timeout``..."""
    if outcome is None:
        return "-"
    text = f"{outcome}: {error}" if error and outcome is Outcome.FAILED else str(outcome)
    return _cut(text, limit) if limit is not None else text


def _unknown(value: Any) -> str:
    return "-" if value is None else str(value)


def _ranking(summary: RunSummary, short: bool = False) -> str:
    """How the run's checkpoints are ordered: by its score (``lowest loss first``), else latest first."""
    score = summary.checkpoint_score_attribute
    if not score:
        return "latest" if short else "latest first"
    side = "lowest" if summary.checkpoint_score_order == "min" else "highest"
    return f"best: {side} {score}" if short else f"best first: {side} {score} first"


def runs_table(summaries: list[RunSummary]) -> str:
    """The table ``spark-torch runs`` prints: one line per run."""
    header = (
        "RUN ID",
        "STARTED",
        "DURATION",
        "OUTCOME",
        "ENTRY",
        "ATTEMPTS",
        "WORLD",
        "STEPS",
        "LAST METRICS",
        "CHECKPOINT (BEST BY SCORE, ELSE LATEST)",
    )
    rows = [
        (
            f"{s.run_id} (replica group {s.replica_group})" if s.replica_run is not None else s.run_id,
            _when(s.started),
            _duration(s.duration),
            _outcome_text(s.outcome, s.error, limit=60),
            _cut(s.entry or "-", 40),
            _unknown(s.attempts),
            _unknown(s.world_size),
            str(s.steps),
            _metrics_text(s.metrics, limit=3),
            f"{s.best_checkpoint.path} ({_ranking(s, short=True)})" if s.best_checkpoint else "-",
        )
        for s in summaries
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header) - 1)]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[-1] for row in [header, *rows]
    )


def run_details(summary: RunSummary, checkpoints: list[Checkpoint]) -> str:
    """What ``spark-torch runs show`` prints: the summary, every attempt, the kept checkpoints."""
    best = "-"
    if summary.best_checkpoint:
        best = f"{summary.best_checkpoint.path} ({_ranking(summary, short=True)})"
    lines = [
        f"run {summary.run_id}",
        f"  path             {summary.path}",
        f"  entry            {summary.entry or '-'}",
        f"  started          {_when(summary.started)}",
        f"  duration         {_duration(summary.duration)}",
        f"  outcome          {_outcome_text(summary.outcome, summary.error)}",
        f"  attempts         {_unknown(summary.attempts)}",
        f"  world size       {_unknown(summary.world_size)} (latest attempt)",
        f"  steps            {summary.steps}",
        f"  last metrics     {_metrics_text(summary.metrics)}",
        f"  best checkpoint  {best}",
    ]
    if summary.calls:
        lines.append("calls (each run() call, oldest first, and its attempts: 0 is the run's first start):")
        for call in summary.calls:
            lines.append(f"  {_when(call.started)}  {call.entry}  {_duration(call.duration)}  {call.outcome}")
            if call.error and call.outcome is not Outcome.SUCCEEDED:
                lines.append(f"    error: {call.error}")
            lines.extend(f"    {_when(row.time)}  {row}" for row in call.attempts)
    elif summary.attempt_log:
        lines.append("attempts (0: the run's first start, counting on across restarts and resumed run() calls):")
        for row in summary.attempt_log:
            lines.append(
                f"  {_when(row.get('time'))}  attempt {row.get('attempt')}: {row.get('world_size')} rank(s) "
                f"on {row.get('nodes')} node(s)"
            )
    lines.append(f"checkpoints ({len(checkpoints)}, {_ranking(summary)}):" if checkpoints else "checkpoints: none")
    for checkpoint in checkpoints:
        lines.append(f"  step {checkpoint.step}  {checkpoint.path}  {_metrics_text(checkpoint.metrics)}")
    return "\n".join(lines)


def summary_json(summary: RunSummary) -> dict[str, Any]:
    """A run's summary as plain JSON data (checkpoints as their paths)."""
    data = asdict(summary)
    for key in ("checkpoint", "best_checkpoint"):
        checkpoint = getattr(summary, key)
        data[key] = (
            None
            if checkpoint is None
            else {"path": checkpoint.path, "step": checkpoint.step, "metrics": checkpoint.metrics}
        )
    plain: dict[str, Any] = json.loads(json.dumps(data, default=str))
    return plain


def load_run(
    storage_path: str | os.PathLike[str] = DEFAULT_STORAGE,
    run_id: str = "",
    *,
    storage_options: dict[str, Any] | None = None,
    checkpoint_score_attribute: str | None = None,
    checkpoint_score_order: str | None = None,
) -> RunResult:
    """Deprecated: use :meth:`RunResult.from_path` (the same arguments)."""
    warnings.warn(
        "spark_torch.load_run() is deprecated; use spark_torch.RunResult.from_path()", DeprecationWarning, stacklevel=2
    )
    if not run_id:
        raise ValueError(
            "load_run() needs the run_id (see distributor.last_run.run_id, or the directory names under storage_path)"
        )
    return RunResult.from_path(
        storage_path,
        run_id,
        storage_options=storage_options,
        checkpoint_score_attribute=checkpoint_score_attribute,
        checkpoint_score_order=checkpoint_score_order,
    )
