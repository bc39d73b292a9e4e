"""Ranges of a staged folder's column files read into memory with ``pread``, not mapped.

:meth:`spark_torch.shared.column_files.StagedColumns.read` reads a window of a rank's rows with
:class:`PartReader`: the rows land in the process's own (anonymous) memory, once, and no page of
the files is mapped, so the rank's resident memory holds the window and not every page of the
files it has read (a mapped file's pages count in it as long as they stay mapped; a kernel with
large page-cache folios maps up to 2 MB on one touch of a byte).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

__all__ = ["PartReader"]


class PartReader:
    """One column's part files (``<index>.<part>`` in ``directory``, of ``dtypes``), opened once each
    for reading ranges of them; closed on leaving a ``with``."""

    def __init__(self, directory: str, index: int, dtypes: dict[str, str]) -> None:
        self.directory, self.index, self.dtypes = directory, index, dtypes
        self._fds: dict[str, int] = {}

    def __enter__(self) -> PartReader:
        return self

    def __exit__(self, *exc: object) -> None:
        for fd in self._fds.values():
            os.close(fd)

    def read(self, part: str, start: int, stop: int, out: Any) -> None:
        """Elements ``start`` .. ``stop - 1`` of ``part`` into ``out`` (a numpy array of that length)."""
        if part not in self._fds:
            self._fds[part] = os.open(os.path.join(self.directory, f"{self.index}.{part}"), os.O_RDONLY)
        view = memoryview(out).cast("B")
        offset, done = start * out.itemsize, 0
        while done < len(view):
            got = os.preadv(self._fds[part], [view[done:]], offset + done)
            if got <= 0:
                raise EOFError(f"{self.directory}: part {self.index}.{part} ends before element {stop}")
            done += got

    def ranges(self, part: str, ranges: Sequence[tuple[int, int]]) -> Any:
        """The elements of ``ranges`` of ``part``, one after the other."""
        import numpy as np

        out = np.empty(sum(stop - start for start, stop in ranges), dtype=np.dtype(self.dtypes[part]))
        at = 0
        for start, stop in ranges:
            if stop > start:
                self.read(part, start, stop, out[at : at + stop - start])
            at += stop - start
        return out

    def nested(self, ends: str, items: str, ranges: Sequence[tuple[int, int]]) -> tuple[Any, Any]:
        """(ends, items) of the rows of ``ranges``: their items one after the other, and the
        ends rebased onto them, as the files hold them for the whole node."""
        import numpy as np

        bounds = []
        for start, stop in ranges:
            edges = self.ranges(ends, [(max(start - 1, 0), stop)])
            first = int(edges[0]) if start > 0 else 0
            bounds.append((first, edges[1:] if start > 0 else edges))
        item_ranges = [(first, int(edges[-1]) if len(edges) else first) for first, edges in bounds]
        all_items = self.ranges(items, item_ranges)
        rebased, at = [], 0
        for (first, edges), (_, last) in zip(bounds, item_ranges):
            rebased.append(edges - first + at)
            at += last - first
        return (np.concatenate(rebased) if rebased else np.zeros(0, np.int64)), all_items
