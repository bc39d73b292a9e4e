"""A replica-group run (``replica_groups=G``) as one :class:`~spark_torch.driver.result.RunResult`.

Each group runs and stores as its own run, ``RUN_ID-g0`` ... ``RUN_ID-g{G-1}``; the whole run is
their merge: every group's rows, each naming its ``replica_group``, in step order; every group's
attempts, each naming its group; the newest checkpoint of any group; the restarts of all groups.
The driver merges a call's groups when it ends (``last_run``), :meth:`RunResult.from_path` a past
run's from their storage.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from spark_torch.reporting.api import GROUP_KEY
from spark_torch.reporting.checkpoint import Checkpoint
from spark_torch.reporting.ranking import CheckpointInfo, best
from spark_torch.reporting.run_log import Outcome
from spark_torch.reporting.storage import run_ids

if TYPE_CHECKING:
    from spark_torch.driver.result import RunResult

__all__ = ["group_run_id", "group_of", "stored_group_ids", "group_rows", "ranked_checkpoints", "merge_past_groups"]


def group_run_id(run_id: str, group: int) -> str:
    """The run id of one group's runs (its storage and its history)."""
    return f"{run_id}-g{group}"


_GROUP_RUN_ID = re.compile(r"(?P<run>.+)-g(?P<group>0|[1-9][0-9]*)")  # as group_run_id spells it


def group_of(run_id: str, stored: Collection[str]) -> tuple[str, int] | None:
    """The replica-group run ``run_id`` is one group of, and that group: ``run_id`` is
    ``RUN_ID-gN`` and ``RUN_ID-g0`` ... ``RUN_ID-gN`` are all in ``stored``, at least two of them
    (a run the user named ``x-g0`` with no ``x-g1`` beside it is not a group); else None."""
    match = _GROUP_RUN_ID.fullmatch(run_id)
    if match is None:
        return None
    run, group = match["run"], int(match["group"])
    if not all(group_run_id(run, other) in stored for other in range(max(group, 1) + 1)):
        return None
    return run, group


def stored_group_ids(base: str, run_id: str, options: Mapping[str, Any] | None = None) -> list[str]:
    """The stored runs of ``run_id``'s groups under ``base``, group 0 first (none: not a
    replica-group run there)."""
    stored = set(run_ids(base, options))
    found: list[str] = []
    while group_run_id(run_id, len(found)) in stored:
        found.append(group_run_id(run_id, len(found)))
    return found


def group_rows(parts: list[tuple[int, list[dict[str, Any]]]]) -> list[dict[str, Any]]:
    """Each group's rows, each with its ``replica_group`` (ranks tag theirs; an older row gets its
    group's), in step order and group order within a step."""
    rows = [{**row, GROUP_KEY: row.get(GROUP_KEY, group)} for group, part in parts for row in part]
    return sorted(rows, key=lambda row: (row.get("step", 0), row[GROUP_KEY]))


def ranked_checkpoints(
    lasts: list[RunResult], score: str | None, order: str = "max"
) -> list[tuple[Checkpoint, dict[str, Any]]]:
    """Every group's kept checkpoints (each group's own folder), ranked together."""
    kept = {c.path: (c, m) for last in lasts for c, m in last.best_checkpoints}
    infos = [CheckpointInfo(c.step, path, metrics=m) for path, (c, m) in kept.items()]
    return [kept[info.url] for info in best(infos, score, order)]


def merge_past_groups(run_id: str, parts: list[RunResult], score: str | None, order: str = "max") -> RunResult:
    """The past run ``run_id`` from its groups' stored runs (``parts``, group 0 first, each as
    :meth:`RunResult.from_path` opened it): what ``last_run`` showed when the call ended, without
    a value. It has no single directory (``path`` None; each group's is in ``replica_groups``)."""
    from spark_torch.driver.result import RunResult

    newest = [part.checkpoint for part in parts if part.checkpoint is not None]
    failed = next((part for part in parts if part.outcome not in (None, Outcome.SUCCEEDED)), None)
    shown = failed if failed is not None else parts[0]
    starts = [part.started for part in parts if part.started is not None]
    ends = [part.started + part.duration for part in parts if part.started is not None and part.duration is not None]
    started = min(starts) if starts else None
    return RunResult(
        run_id=run_id, replica_groups=list(parts),
        history=group_rows([(group, part.history) for group, part in enumerate(parts)]),
        best_checkpoints=ranked_checkpoints(parts, score, order),
        checkpoint=max(newest, key=lambda c: c.step) if newest else None,
        attempts=[replace(record, replica_group=group) for group, part in enumerate(parts) for record in part.attempts],
        # a group restarted alone goes on in the same call of its group's run: every attempt after a group's first
        restarts=sum(max(0, len(part.attempts) - 1) for part in parts),
        outcome=shown.outcome, entry=shown.entry, past_error=shown.past_error, started=started,
        duration=max(ends) - started if ends and started is not None else None,
    )  # fmt: skip
