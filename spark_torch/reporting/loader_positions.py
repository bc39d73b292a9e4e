"""The data loaders' positions travel with a checkpoint: one owner of that cross-process contract.

A rank's loaders (:mod:`spark_torch.rank.positions`) say where they are; every
:func:`~spark_torch.reporting.api.report` sends this rank's positions with its step (a list, the
loaders in the order the rank made them); the node runner forwards its ranks' lists by rank
(:func:`by_rank`); the driver keeps them in the manifest of a step with a checkpoint
(``"loaders": {"RANK": [...]}``, :meth:`~spark_torch.reporting.storage.RunStorage.complete`), so
every rank's position is kept even when only rank 0 passes a checkpoint; a rank of a resumed run
reads its own list back (:func:`saved`). Imports neither torch nor pyspark.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from spark_torch.base import envnames

__all__ = ["KEY", "Positions", "track", "current", "by_rank", "checked", "saved", "MAX_BYTES"]

#: the key of the positions in a rank's report, a node's report and a checkpoint's manifest
KEY = "loaders"
#: bound on one rank's positions in a report (a position is about 200 bytes)
MAX_BYTES = 64 * 1024

#: a rank's positions: each loader's, in the order it made them (None: a loader that is gone)
Positions = list[dict[str, Any] | None]

_source: Callable[[], Positions] | None = None
_warned = False


def track(source: Callable[[], Positions] | None) -> None:
    """From now on :func:`current` (what report() sends) is ``source()``: the rank's loaders' positions."""
    global _source
    _source = source


def current() -> Positions:
    """This rank's loaders' positions now (none made: an empty list; over :data:`MAX_BYTES`: none,
    with a warning, once)."""
    global _warned
    if _source is None:
        return []
    positions = _source()
    if len(json.dumps(positions)) > MAX_BYTES:
        if not _warned:
            _warned = True
            warnings.warn(
                f"spark_torch: this rank's {len(positions)} data loaders' positions take more than {MAX_BYTES} bytes: "
                "report() keeps none (a resumed run starts its epochs again). Make one rank_loader() per data set "
                "and iterate it every epoch, not one per epoch",
                UserWarning,
                stacklevel=3,
            )
        return []
    return positions


def by_rank(messages: Mapping[int, Mapping[str, Any]]) -> dict[str, list[Any]]:
    """The positions in the ranks' report messages of one step, by rank (as text: a JSON key)."""
    return {str(rank): list(m[KEY]) for rank, m in sorted(messages.items()) if isinstance(m.get(KEY), list) and m[KEY]}


def checked(value: Any) -> dict[str, list[Any]]:
    """A node's positions by rank, as the driver accepts them (ValueError: not that shape)."""
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and k.isdigit() and isinstance(v, list) and all(p is None or isinstance(p, dict) for p in v)
        for k, v in value.items()
    ):
        raise ValueError(f"{KEY} must be an object of rank -> list of positions")
    return value


def saved(rank: int | None = None) -> Positions | None:
    """The positions rank ``rank`` (default: ``RANK``) reported with the checkpoint this rank
    resumes from (``SPARK_TORCH_CHECKPOINT``), in the order it made its loaders; a rank the
    checkpoint holds none for (the world grew) gets the lowest rank's (its epoch: every rank
    then starts the same epoch); None on a fresh start or when none were kept."""
    from spark_torch.reporting.storage import MANIFEST

    directory = os.environ.get(envnames.CHECKPOINT)
    if not directory:
        return None
    rank = int(os.environ.get(envnames.RANK, "0")) if rank is None else rank
    try:
        with open(os.path.join(directory, MANIFEST), encoding="utf-8") as fh:
            manifest = json.load(fh)
    except (OSError, ValueError):
        return None
    kept = manifest.get(KEY) if isinstance(manifest, dict) else None
    if not isinstance(kept, dict) or not kept:
        return None
    ranks = sorted(int(k) for k in kept if isinstance(k, str) and k.isdigit())
    if not ranks:
        return None
    positions = kept.get(str(rank), kept[str(ranks[0])])
    return [p if isinstance(p, dict) else None for p in positions] if isinstance(positions, list) else None
