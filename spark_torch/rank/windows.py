"""The order a rank reads its rows in, one window at a time: what bounds a rank's memory.

A rank reads its epoch in windows of whole batches that together take about
:data:`WINDOW_BYTES` in the column files (at least one batch): each window's rows are read into
memory once (:meth:`~spark_torch.shared.column_files.StagedColumns.read`, ``pread``, no pages
mapped), its batches are gathered from there, and the next window replaces it. So a rank holds
one window and one batch of rows whatever the rows it owns.

Shuffled (``shuffle=True``), an epoch is a two-level shuffle, seeded by ``(seed, epoch)``:

1. the rank's epoch rows (``0 .. count - 1``) are cut into blocks of ``window /``
   :data:`BLOCKS_PER_WINDOW` rows, and the blocks are put in a random order;
2. that sequence of rows is cut into windows of ``window`` rows (so a window's rows come from
   about :data:`BLOCKS_PER_WINDOW` stretches scattered over the rank's rows), and each window's
   rows are permuted uniformly (seeded by ``(seed, epoch, window)``).

Every row is in exactly one window, so each epoch still holds every row once. A rank whose rows
fit in one window (at most :data:`WINDOW_BYTES`) gets a uniform permutation of all of them;
above that, two rows of the same block always fall in the same window (the same part of the
epoch), as with a shuffle buffer. In order (``shuffle=False``) the windows are consecutive.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from spark_torch.shared.column_files import StagedColumns

__all__ = ["WINDOW_BYTES", "BLOCKS_PER_WINDOW", "window_rows", "EpochWindows", "Windows", "file_ranges"]

#: about how many bytes of rows (as the column files hold them) a rank reads into memory at once
WINDOW_BYTES = 32 * 2**20
#: into how many stretches of the rank's rows a shuffled window is cut
BLOCKS_PER_WINDOW = 256


def window_rows(row_bytes: float, batch_size: int, count: int) -> int:
    """Rows per window: as many whole batches as fit in :data:`WINDOW_BYTES` (at least one), and
    no more than the epoch's ``count`` rounded up to whole batches."""
    batches = max(1, int(WINDOW_BYTES // max(row_bytes * batch_size, 1.0)))
    return max(batch_size, min(batches, -(-count // batch_size)) * batch_size)


class EpochWindows:
    """One epoch's rows window by window: which rows (``0 .. count - 1`` of the rank's epoch) a
    window holds, in the order :meth:`rows` lists them, and the order its batches take them in."""

    def __init__(self, count: int, window: int, shuffle: bool, seed: int, epoch: int) -> None:
        import numpy as np

        self.count, self.window, self.shuffle, self.seed, self.epoch = count, window, shuffle, seed, epoch
        if shuffle:
            block = max(1, -(-window // BLOCKS_PER_WINDOW))
            starts = np.arange(0, count, block, dtype=np.int64)
            starts = starts[np.random.default_rng([seed, epoch]).permutation(len(starts))]
        else:
            block, starts = max(count, 1), np.zeros(1, dtype=np.int64)
        self._starts = starts
        self._stops = np.minimum(starts + block, count)
        #: where each block begins in the epoch's sequence of rows
        self._at = np.concatenate([[0], np.cumsum(self._stops - self._starts)])

    def __len__(self) -> int:
        return -(-self.count // self.window)

    def rows(self, w: int) -> list[tuple[int, int]]:
        """Window ``w``'s rows as ``(start, stop)`` ranges of the epoch's rows, in the window's order."""
        import numpy as np

        low, high = w * self.window, min((w + 1) * self.window, self.count)
        first = int(np.searchsorted(self._at, low, side="right")) - 1
        out = []
        for b in range(first, len(self._starts)):
            if self._at[b] >= high:
                break
            start = int(self._starts[b]) + max(low - int(self._at[b]), 0)
            stop = int(self._starts[b]) + min(high, int(self._at[b + 1])) - int(self._at[b])
            out.append((start, stop))
        return out

    def order(self, w: int) -> Any:
        """The order window ``w``'s batches take its rows in (indices into :meth:`rows`' rows), or
        None: in order."""
        import numpy as np

        if not self.shuffle:
            return None
        size = min((w + 1) * self.window, self.count) - w * self.window
        return np.random.default_rng([self.seed, self.epoch, w]).permutation(size)


class Sharding(Protocol):
    """Where a rank's rows are in its node's files: the epoch's row ``j`` (``0 <= j < count``) is at
    ``first + j % own``."""

    first: int
    own: int
    count: int


def file_ranges(rows: Sequence[tuple[int, int]], sharding: Sharding) -> list[tuple[int, int]]:
    """The file positions of ``(start, stop)`` ranges of the epoch's rows, as ranges in the same
    order (a range is cut where a rank with fewer rows than the epoch wraps around to its first)."""
    out = []
    for start, stop in rows:
        while start < stop:
            offset = start % sharding.own
            length = min(stop - start, sharding.own - offset)
            out.append((sharding.first + offset, sharding.first + offset + length))
            start += length
    return out


class Windows:
    """An iteration's batches, gathered from the window they are in, read once when first needed
    (the window before is let go first: one window is held at a time)."""

    def __init__(
        self, staged: StagedColumns, columns: Sequence[str], sharding: Sharding, window: int, shuffle: bool, seed: int
    ) -> None:
        self.staged, self.columns, self.sharding = staged, list(columns), sharding
        self.window, self.shuffle, self.seed = window, shuffle, seed
        self._epoch: EpochWindows | None = None
        self._loaded = -1
        self._rows: StagedColumns | None = None
        self._order: Any = None

    def batch(self, epoch: int, start: int, stop: int) -> tuple[StagedColumns, Any]:
        """The rows holding the epoch's batch of rows ``start .. stop - 1`` (a window's batches
        are whole: the batch lies in one window), and the batch's indices into them."""
        import numpy as np

        if self._epoch is None or self._epoch.epoch != epoch:
            self._epoch = EpochWindows(self.sharding.count, self.window, self.shuffle, self.seed, epoch)
            self._loaded = -1
        w = start // self.window
        if w != self._loaded:
            self._rows = self._order = None
            self._rows = self.staged.read(self.columns, file_ranges(self._epoch.rows(w), self.sharding))
            self._order, self._loaded = self._epoch.order(w), w
        assert self._rows is not None
        local = np.arange(start - w * self.window, stop - w * self.window)
        return self._rows, self._order[local] if self._order is not None else local
