"""A replica-group run (``replica_groups=G``) as one :class:`~spark_torch.driver.result.RunResult`.

Each group runs and stores as its own run, ``RUN_ID-g0`` ... ``RUN_ID-g{G-1}``; the whole run is
their merge: every group's rows, each naming its ``replica_group``, in step order; every group's
attempts, each naming its group; the newest checkpoint of any group; the restarts of all groups.
The merge itself, one rule for a call's ``last_run`` and a past run's :meth:`RunResult.from_path`,
is :func:`~spark_torch.driver.result.merge_groups`; this module has the parts it is made of and
imports nothing of the driver.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from spark_torch.reporting.api import GROUP_KEY
from spark_torch.reporting.checkpoint import Checkpoint
from spark_torch.reporting.ranking import CheckpointInfo, best
from spark_torch.reporting.storage import run_ids

__all__ = ["group_run_id", "group_of", "stored_group_ids", "group_rows", "ranked_checkpoints"]


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


def stored_group_ids(base: str, run_id: str, options: Mapping[str, Any] | None) -> list[str]:
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
    kept_per_group: Sequence[Sequence[tuple[Checkpoint, dict[str, Any]]]], score: str | None, order: str = "max"
) -> list[tuple[Checkpoint, dict[str, Any]]]:
    """Every group's kept checkpoints (each group's ``best_checkpoints``, in its own folder),
    ranked together."""
    kept = {c.path: (c, m) for group in kept_per_group for c, m in group}
    infos = [CheckpointInfo(c.step, path, metrics=m) for path, (c, m) in kept.items()]
    return [kept[info.url] for info in best(infos, score, order)]
