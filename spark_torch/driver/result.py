"""What a ``run()`` produced (:class:`RunResult`, ``distributor.last_run``), its checkpoints
(:class:`Checkpoint`), and a past run opened from its storage (:meth:`RunResult.from_path`).

The names follow Ray Train's ``Result`` where they mean the same thing: ``metrics`` is the last
reported metrics dict, ``metrics_dataframe`` the whole history, ``checkpoint`` the latest
checkpoint, ``best_checkpoints`` the kept ones with their metrics, best first.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from spark_torch.driver.attempts import (
    AttemptEnd,
    AttemptError,
    AttemptReason,
    AttemptRecord,
    AttemptSize,
    GrowRequest,
    SizeReason,
    attempt_record,
)
from spark_torch.driver.group_runs import group_rows, ranked_checkpoints, stored_group_ids
from spark_torch.reporting.api import GROUP_KEY, RECORDED_KEYS
from spark_torch.reporting.checkpoint import Checkpoint, persisted_checkpoint
from spark_torch.reporting.ranking import best, recorded_score
from spark_torch.reporting.run_log import Outcome, read_calls
from spark_torch.reporting.storage import RUN_LOG, RUN_MARKER, RunStorage, run_ids, split_run_path
from spark_torch.reporting.storage_keys import remember
from spark_torch.shared.staged_shards import Staging

__all__ = [
    "RunResult",
    "Checkpoint",
    "AttemptEnd",
    "AttemptReason",
    "AttemptRecord",
    "AttemptSize",
    "SizeReason",
    "AttemptError",
    "GrowRequest",
    "StoredRun",
    "read_stored",
    "merge_groups",
]


def _short(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _value_note(value: Any) -> str:
    """A value's type and size, never its contents: ``dict, 42 items``, ``Tensor, shape (3, 4)``."""
    kind = type(value).__name__
    shape = getattr(value, "shape", None)
    if shape is not None and not callable(shape):
        try:
            return f"{kind}, shape {tuple(shape)}"
        except TypeError:
            return kind
    if isinstance(value, (str, bytes, bytearray)):
        return f"{kind}, {len(value)} {'characters' if isinstance(value, str) else 'bytes'}"
    try:
        size = len(value)
    except Exception:  # noqa: BLE001 - any object: no len() is no size
        return kind
    return f"{kind}, {size} item{'s' if size != 1 else ''}"


@dataclass(frozen=True, repr=False)
class RunResult:
    """The outcome of a ``run()``/``run_on_dataframe()`` call (or of a past run: :meth:`RunResult.from_path`).

    Made once, when the call ends (from what it recorded as it ran: :class:`~spark_torch.driver.run_record.RunRecord`),
    and not changed after. It is made in four places, one per reason: a call's end
    (``RunRecord.finish``), a call that failed before it ran, only its id (``RunRecord.final``), a
    past run (:meth:`from_path`), and a replica-group run, its groups' merged (:func:`merge_groups`,
    for a call and a past run alike). It holds no storage option, nor does anything in it (the pickling rule:
    its checkpoints hold a :class:`~spark_torch.reporting.storage_keys.StorageKey`), so it pickles
    and copies without a credential; a pickle opened in another process needs the options again
    to download a checkpoint (``checkpoint.to_directory(storage_options=...)``).

    Attributes:
        run_id: the run's id (pass it again as ``run_id=`` to resume from its checkpoint).
        value: rank 0's return value (what ``run()`` returned; None for scripts or failures).
        rows: one dict per ``report()`` step persisted by this call: rank 0's metrics plus
            ``step``, ``time`` (Unix seconds), ``attempt`` (0, then 1 after the first restart;
            a later call that resumes the ``run_id`` numbers on) and ``world_size`` (the ranks
            of that attempt).
        history: every step of the run across restarts and earlier ``run()`` calls with this
            ``run_id`` (from its storage; a step reported again after a restart: the newest row).
        checkpoint: the latest complete :class:`Checkpoint`, or None.
        best_checkpoints: the run's kept checkpoints with their metrics, best first
            (``checkpoint_score_attribute``/``checkpoint_score_order``; else newest first).
        restarts: how many times the gang was restarted in this call (after failures, or to grow).
        attempts: one :class:`AttemptRecord` per attempt of this call: its size, why it started
            (:class:`AttemptReason`) and how it ended (:class:`AttemptEnd`).
        error: the exception when the run failed (``run()`` raised it too).
        path: the run's directory: its log, checkpoints and metrics (None: no storage could be
            created). Every run keeps one (``spark-torch runs`` lists it), even one that reported nothing.
        outcome: how the call ended (:class:`~spark_torch.reporting.run_log.Outcome`: succeeded,
            failed, stopped by timeout, by a stall or by Ctrl-C); None while it runs.
        entry: what it ran: the function's name, or the script and its arguments.
        started: when the call started (Unix seconds).
        duration: how long it took, in seconds.
        error_line: for a past run (:meth:`from_path`), its error's type and first line (``error``
            itself stays None there); for this call, the same from ``error``.
        staging: with ``run_on_dataframe(..., reuse_staged=True)``, how the last attempt's rows
            reached the ranks (:class:`~spark_torch.shared.staged_shards.Staging`: staged and
            kept, reused, staged again, not kept); else None.
        replica_groups: with ``replica_groups``, each group's own last run (``run_id`` RUN_ID-gN,
            its ``path``); the call's ``rows``, ``history`` and ``attempts`` are every group's, each
            row with its ``replica_group``. Empty otherwise.
    """

    run_id: str
    value: Any = None
    rows: list[dict[str, Any]] = field(default_factory=list)
    history: list[dict[str, Any]] = field(default_factory=list)
    checkpoint: Checkpoint | None = None
    best_checkpoints: list[tuple[Checkpoint, dict[str, Any]]] = field(default_factory=list)
    restarts: int = 0
    error: BaseException | None = None
    path: str | None = None
    attempts: list[AttemptRecord] = field(default_factory=list)
    outcome: Outcome | None = None
    entry: str | None = None
    started: float | None = None
    duration: float | None = None
    past_error: str | None = field(default=None, repr=False)
    replica_groups: list[RunResult] = field(default_factory=list)
    staging: Staging | None = None

    @property
    def error_line(self) -> str | None:
        """The error's type and first line (a past run's, as its log kept it), or None."""
        if self.error is not None:
            first = (str(self.error).splitlines() or [""])[0]
            return f"{type(self.error).__name__}: {first}" if first else type(self.error).__name__
        return self.past_error

    def __repr__(self) -> str:
        """Short, whatever the value: its type and size, not its contents (a notebook that shows
        ``last_run`` prints one line, not a state_dict)."""
        parts = [f"run_id={self.run_id!r}"]
        if self.outcome is not None:
            parts.append(f"outcome={str(self.outcome)!r}")
        parts.append("value=None" if self.value is None else f"value=<{_value_note(self.value)}>")
        parts.append(f"steps={self.steps}")
        if self.checkpoint is not None:
            parts.append(f"checkpoint={self.checkpoint.path!r}")
        parts.append(f"restarts={self.restarts}")
        if self.error_line is not None:
            parts.append(f"error={_short(self.error_line)!r}")
        if self.path is not None:
            parts.append(f"path={self.path!r}")
        return f"RunResult({', '.join(parts)})"

    @property
    def steps(self) -> int:
        """How many steps the run reported (its history's rows); with ``replica_groups``, the
        highest step any group reported: the groups report torchft's committed steps, the same
        steps, so their rows are not added up."""
        rows = self.history or self.rows
        if self.replica_groups:
            return max((row["step"] for row in rows if isinstance(row.get("step"), int)), default=0)
        return len(rows)

    @property
    def metrics(self) -> dict[str, Any]:
        """The last reported metrics (with ``step``, ``time``, ``attempt``, ``world_size``); ``{}`` before any."""
        rows = self.history or self.rows
        return dict(rows[-1]) if rows else {}

    @property
    def metrics_dataframe(self) -> Any:
        """The whole history as a pandas DataFrame (columns: the reported keys, ``step``, ``time``,
        ``attempt``, ``world_size``), one row per step."""
        try:
            import pandas as pd
        except ImportError as exc:  # pragma: no cover - pandas comes with the spark extra
            raise ImportError(
                "RunResult.metrics_dataframe needs pandas (pip install pandas); RunResult.history has the same data"
            ) from exc
        frame = pd.DataFrame(self.history or self.rows)
        if frame.empty:
            return pd.DataFrame(columns=[k for k in RECORDED_KEYS if k != GROUP_KEY])
        ordered = [c for c in frame.columns if c not in RECORDED_KEYS] + [
            c for c in RECORDED_KEYS if c in frame.columns
        ]
        return frame[ordered].sort_values("step", kind="stable").reset_index(drop=True)

    @classmethod
    def from_path(
        cls,
        storage_path: str | os.PathLike[str],
        run_id: str | None = None,
        *,
        storage_options: dict[str, Any] | None = None,
        checkpoint_score_attribute: str | None = None,
        checkpoint_score_order: str | None = None,
    ) -> RunResult:
        """A past run, opened from its storage (its history and checkpoints; no value).

        ``RunResult.from_path(run_dir)`` takes the run's own directory (``STORAGE/RUN_ID``, what
        ``RunResult.path`` says; Ray Train's ``Result.from_path``); ``from_path(storage_path,
        run_id)`` the storage and the run's id. ``best_checkpoints`` are ordered as the run's
        ``last_run`` ordered them (the ``checkpoint_score_attribute``/``checkpoint_score_order``
        its latest attempt was configured with, stored with the run), unless these are given.

        A replica-group run (``replica_groups``; each group stored as its own run, ``RUN_ID-g0``,
        ...) opens whole by its ``RUN_ID``: every group's history and attempts, each naming its
        group, and each group's own run in ``replica_groups`` (``path`` is None).

        Raises:
            FileNotFoundError: no run there (the message lists the runs when ``run_dir`` is a
                storage directory).
        """
        text = os.fspath(storage_path)
        path_form = run_id is None
        if run_id is None:
            base, run_id = split_run_path(text)
            storage = RunStorage(base, run_id, storage_options)
            found = bool(run_id) and storage.is_run()
        else:
            base, storage = text, RunStorage(text, run_id, storage_options)
            found = storage.exists()
        if not found:
            groups = stored_group_ids(base, run_id, storage_options) if run_id else []
            if groups:  # a replica-group run: its groups' runs, merged
                attempts = RunStorage(base, groups[0], storage_options).attempts()
                score, order = recorded_score(attempts, checkpoint_score_attribute, checkpoint_score_order)
                parts = [
                    cls.from_path(
                        base,
                        g,
                        storage_options=storage_options,
                        checkpoint_score_attribute=score,
                        checkpoint_score_order=order,
                    )
                    for g in groups
                ]
                return merge_groups(run_id, dict(enumerate(parts)), score, order)
            if path_form:
                raise FileNotFoundError(_not_a_run(text, storage_options))
            raise FileNotFoundError(f"no run {run_id!r} under {storage.base} (looked for {storage.url})")
        stored = read_stored(
            storage, (), *recorded_score(storage.attempts(), checkpoint_score_attribute, checkpoint_score_order)
        )
        calls = read_calls(storage.read_log(RUN_LOG))
        # the latest call: what it ran and how it ended, its restarts; every call's attempts
        logged: dict[str, Any] = (
            {}
            if not calls
            else dict(
                outcome=calls[-1].outcome,
                entry=calls[-1].entry,
                started=calls[-1].started,
                duration=calls[-1].duration,
                past_error=calls[-1].error,
                attempts=[attempt_record(row) for call in calls for row in call.attempts],
                restarts=restarts_of(calls[-1].attempts),
            )
        )
        return cls(run_id=run_id, **logged, **vars(stored))


def restarts_of(attempts: Sequence[object]) -> int:
    """A call's restarts: its attempts after the first (the one rule: a call's end, a past
    run's latest call, a replica group's call made of several runs)."""
    return max(0, len(attempts) - 1)


def merge_groups(
    run_id: str,
    parts: Mapping[int, RunResult],
    score: str | None,
    order: str = "max",
    *,
    shown: int | None = None,
    value: Any = None,
    error: BaseException | None = None,
    outcome: Outcome | None = None,
    started: float | None = None,
    ended: float | None = None,
) -> RunResult:
    """A replica-group run as one result, from each group's own (``parts``, by group): the one
    merge of a call's ``last_run`` (the driver passes what only it knows: group 0's ``value``, the
    ``error``, an ``outcome`` that overrides the shown group's (Ctrl-C), when the call
    ``started`` and ``ended``) and of a past run's (:meth:`RunResult.from_path`). Every group's
    rows, history and attempts, each naming its group; the newest checkpoint of any group; the
    kept checkpoints ranked together (``score``/``order``); the restarts of every group, each
    counted as its own call counts them (:func:`restarts_of`). The outcome, entry and error line
    are group ``shown``'s (default: the first that did not succeed, else the first). It has no
    single directory (``path`` None; each group's is in ``replica_groups``)."""
    groups = sorted(parts)
    if shown is None:
        shown = next(
            (g for g in groups if parts[g].outcome not in (None, Outcome.SUCCEEDED)), groups[0] if groups else None
        )
    face = parts[shown] if shown is not None else RunResult(run_id=run_id)
    newest = [c for c in (parts[g].checkpoint for g in groups) if c is not None]
    starts = [s for s in (parts[g].started for g in groups) if s is not None]
    ends = [p.started + p.duration for p in parts.values() if p.started is not None and p.duration is not None]
    started = started if started is not None else min(starts, default=None)
    ended = ended if ended is not None else max(ends, default=None)
    return RunResult(
        run_id=run_id,
        value=value,
        replica_groups=[parts[g] for g in groups],
        error=error,
        rows=group_rows([(g, parts[g].rows) for g in groups]),
        history=group_rows([(g, parts[g].history) for g in groups]),
        best_checkpoints=ranked_checkpoints([parts[g].best_checkpoints for g in groups], score, order),
        checkpoint=max(newest, key=lambda c: c.step) if newest else None,
        attempts=[replace(record, replica_group=g) for g in groups for record in parts[g].attempts],
        restarts=sum(parts[g].restarts for g in groups),
        outcome=outcome if outcome is not None else face.outcome,
        entry=face.entry,
        past_error=face.past_error,
        started=started,
        duration=ended - started if ended is not None and started is not None else None,
    )


@dataclass(frozen=True)
class StoredRun:
    """What a run's storage says about it: its directory, history and checkpoints (its fields
    are :class:`RunResult`'s of the same names: ``RunResult(..., **vars(stored))``)."""

    path: str | None = None
    history: list[dict[str, Any]] = field(default_factory=list)
    checkpoint: Checkpoint | None = None
    best_checkpoints: list[tuple[Checkpoint, dict[str, Any]]] = field(default_factory=list)


def read_stored(
    storage: RunStorage | None, rows: Sequence[dict[str, Any]], score: str | None = None, order: str = "max"
) -> StoredRun:
    """The run's ``path``, ``history``, ``checkpoint`` and ``best_checkpoints`` from its storage
    (ranked by ``score``/``order``); without storage (or before any step was stored) the history
    is the call's own ``rows``. The driver reads it when a run ends, :meth:`RunResult.from_path`
    for a past run."""
    if storage is None:
        return StoredRun(history=list(rows))
    complete, _ = storage.checkpoints()
    key = remember(storage.options)  # the checkpoints hold the key, not the options (the pickling rule)
    return StoredRun(
        path=storage.url,
        history=storage.history() or list(rows),
        checkpoint=persisted_checkpoint(complete[-1], key) if complete else None,
        best_checkpoints=[
            (persisted_checkpoint(info, key), dict(info.metrics)) for info in best(complete, score, order)
        ],
    )


def _not_a_run(path: str, options: dict[str, Any] | None) -> str:
    """Why ``RunResult.from_path(path)`` found no run, and what to pass instead."""
    text = f"RunResult.from_path({path!r}): not a run's directory (no {RUN_MARKER} in it)"
    runs = run_ids(path, options)
    if not runs:
        return (
            text
            + "; pass the run's own directory (STORAGE/RUN_ID, what RunResult.path says), or (storage_path, run_id)"
        )
    example = os.path.join(path, runs[0]) if "://" not in path else f"{path.rstrip('/')}/{runs[0]}"
    shown = ", ".join(runs[:5]) + (", ..." if len(runs) > 5 else "")
    return text + f"; it is a storage holding the runs {shown}: pass one run's directory, e.g. {example!r}"
