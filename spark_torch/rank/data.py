"""Inside a rank started by :meth:`Distributor.run_on_dataframe`: this rank's rows as tensors.

The node runner writes the node's share of the DataFrame to an Arrow IPC file
(``SPARK_TORCH_DATA_FILE``); rank ``LOCAL_RANK`` of the node owns every
``LOCAL_WORLD_SIZE``-th row of it, so each row belongs to exactly one rank. The file is
memory-mapped and gathered batch by batch: a rank never holds its whole shard in memory, and
numeric columns become tensors without copies where Arrow allows.

**Every rank gets the same number of rows, and so the same number of batches**, with
``torch.utils.data.DistributedSampler``'s semantics (DDP waits in every all-reduce for every
rank; a rank with one batch more would wait until the collective timeout). Spark spreads rows
over nodes unevenly (by up to the number of input partitions), so from every node's row count
(``SPARK_TORCH_DATA_ROWS``, known after the rendezvous) each rank computes the common count:

- ``drop_last=False`` (default): the largest share; a rank with fewer rows repeats its own
  first rows (wrapping around) to reach it. No row is left out; at most ``max - min`` rows per
  rank are seen twice in an epoch.
- ``drop_last=True``: the smallest share; a rank with more rows leaves its last ones out (its
  last ones in file order, before any shuffle), and the last incomplete batch is dropped too.

Column types (:mod:`spark_torch.rank.columns`): integer/float/bool scalars -> 1-D tensors;
arrays of numbers -> 2-D tensors (fixed length) or lists of 1-D tensors (ragged); Spark ML
vectors (dense or sparse) -> 2-D float64 tensors; strings -> lists of str; binary -> lists of bytes.

Example::

    from spark_torch.rank.data import rank_loader

    def train():
        for epoch in range(3):
            for batch in rank_loader(batch_size=256, shuffle=True, seed=0):
                x, y = batch["features"], batch["label"]
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from typing import Any

from spark_torch import envnames
from spark_torch.rank.columns import column_kind, to_tensor

__all__ = [
    "rank_dataset",
    "rank_loader",
    "RankDataset",
    "column_kind",
    "rank_positions",
]

def rank_positions(
    node_rows: int, local_rank: int, local_world_size: int, rows_per_node: Sequence[int] | None, drop_last: bool
) -> list[int]:
    """The row positions (in this node's file) one rank iterates per epoch (pure).

    Its own rows are ``local_rank, local_rank + local_world_size, ...``; with ``rows_per_node``
    (every node's row count) they are padded by wrapping around (``drop_last=False``) or cut
    (``drop_last=True``) to the count every rank of the world gets.
    """
    own = list(range(local_rank, node_rows, local_world_size))
    if not rows_per_node:
        return own
    shares = [len(range(j, rows, local_world_size)) for rows in rows_per_node for j in range(local_world_size)]
    target = min(shares) if drop_last else max(shares)
    if len(own) >= target or not own:
        return own[:target]
    return [own[i % len(own)] for i in range(target)]


class RankDataset:
    """An ``IterableDataset`` of this rank's rows, yielding whole batches.

    Each iteration is one epoch (or ``epochs`` epochs back to back); with ``shuffle``, the
    order is a permutation seeded by ``seed`` and the epoch number, so it differs per epoch
    and is reproducible. With DataLoader workers, each worker yields a disjoint set of batches.
    """

    def __init__(
        self,
        path: str,
        *,
        batch_size: int,
        columns: Sequence[str] | None = None,
        as_tuple: bool = False,
        shuffle: bool = False,
        seed: int = 0,
        drop_last: bool = False,
        epochs: int = 1,
        local_rank: int | None = None,
        local_world_size: int | None = None,
        rows_per_node: Sequence[int] | None = None,
    ) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
            raise ValueError(f"epochs must be an int >= 1, got {epochs!r}")
        self.path = path
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epochs = epochs
        self.epoch = 0
        self.local_rank = int(os.environ.get(envnames.LOCAL_RANK, "0")) if local_rank is None else local_rank
        self.local_world_size = (
            int(os.environ.get(envnames.LOCAL_WORLD_SIZE, "1")) if local_world_size is None else local_world_size
        )
        if rows_per_node is None and os.environ.get(envnames.DATA_ROWS):
            rows_per_node = [int(r) for r in json.loads(os.environ[envnames.DATA_ROWS])]
        self.rows_per_node = list(rows_per_node) if rows_per_node is not None else None
        schema = self._reader().schema
        names = list(columns) if columns is not None else list(schema.names)
        missing = [c for c in names if c not in schema.names]
        if missing:
            raise KeyError(f"columns {missing} are not in the data (available: {schema.names})")
        self.columns = names
        self.as_tuple = as_tuple
        self.kinds: dict[str, str] = {}
        for name in names:
            try:
                self.kinds[name] = column_kind(schema.field(name).type)
            except TypeError as exc:
                raise TypeError(f"column {name!r}: {exc}") from None

    def _reader(self) -> Any:
        import pyarrow as pa

        return pa.ipc.open_file(pa.memory_map(self.path, "r"))

    def __len__(self) -> int:
        """Batches per epoch on this rank (before splitting among DataLoader workers)."""
        rows = self.num_rows()
        return rows // self.batch_size if self.drop_last else -(-rows // self.batch_size)

    def num_rows(self) -> int:
        """Rows this rank iterates per epoch (the same on every rank: see the module docstring)."""
        return len(self._positions())

    def _positions(self) -> list[int]:
        reader = self._reader()
        total = sum(reader.get_batch(i).num_rows for i in range(reader.num_record_batches))
        return rank_positions(total, self.local_rank, self.local_world_size, self.rows_per_node, self.drop_last)

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch whose shuffle order the next iteration uses."""
        self.epoch = epoch

    def _convert(self, table: Any) -> Any:
        values = [to_tensor(table.column(name), self.kinds[name]) for name in self.columns]
        if self.as_tuple:
            return tuple(values)
        return dict(zip(self.columns, values))

    def _epoch_batches(self, epoch: int, worker: int, workers: int) -> Iterator[Any]:
        import numpy as np
        import pyarrow as pa

        # the file is memory-mapped: read_all maps it, take() gathers one batch at a time
        table = self._reader().read_all().select(self.columns)
        order = np.asarray(self._positions(), dtype=np.int64)
        if self.shuffle:
            order = order[np.random.default_rng([self.seed, epoch]).permutation(len(order))]
        stop = len(order) - (len(order) % self.batch_size if self.drop_last else 0)
        for index, start in enumerate(range(0, stop, self.batch_size)):
            if index % workers == worker:
                yield self._convert(table.take(pa.array(order[start : start + self.batch_size])))

    def __iter__(self) -> Iterator[Any]:
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        first = self.epoch
        for epoch in range(first, first + self.epochs):
            yield from self._epoch_batches(epoch, worker, workers)


def _make_iterable_dataset(dataset: RankDataset) -> Any:
    from torch.utils.data import IterableDataset

    class _Iterable(IterableDataset):  # type: ignore[type-arg]
        def __init__(self, inner: RankDataset) -> None:
            self.inner = inner

        def __iter__(self) -> Iterator[Any]:
            return iter(self.inner)

        def __len__(self) -> int:
            return len(self.inner)

    return _Iterable(dataset)


def _data_file() -> str:
    path = os.environ.get(envnames.DATA_FILE)
    if not path:
        raise RuntimeError(
            f"{envnames.DATA_FILE} is not set: spark_torch.rank.data works inside a function started by "
            "Distributor.run_on_dataframe(main, df, ...)"
        )
    return path


def _default_columns(columns: Sequence[str] | None) -> tuple[list[str] | None, bool]:
    if columns is not None:
        return list(columns), True
    chosen = os.environ.get(envnames.DATA_COLUMNS)
    if chosen:
        return list(json.loads(chosen)), True
    return None, False


def rank_dataset(
    batch_size: int = 1,
    *,
    columns: Sequence[str] | None = None,
    shuffle: bool = False,
    seed: int = 0,
    drop_last: bool = False,
    epochs: int = 1,
) -> Any:
    """This rank's rows as a ``torch.utils.data.IterableDataset`` that yields whole batches.

    Batches are dicts of column name -> tensor (or list), or tuples in ``columns`` order when
    columns were given here or to ``run_on_dataframe``.
    """
    cols, as_tuple = _default_columns(columns)
    inner = RankDataset(
        _data_file(), batch_size=batch_size, columns=cols, as_tuple=as_tuple, shuffle=shuffle,
        seed=seed, drop_last=drop_last, epochs=epochs,
    )
    return _make_iterable_dataset(inner)


def rank_loader(
    batch_size: int,
    *,
    columns: Sequence[str] | None = None,
    shuffle: bool = False,
    seed: int = 0,
    drop_last: bool = False,
    num_workers: int = 0,
    epochs: int = 1,
) -> Any:
    """A ``DataLoader`` over this rank's rows; each ``iter()`` is the next epoch.

    ``shuffle`` reorders rows per epoch from ``seed`` (reproducible); ``num_workers`` > 0
    splits the batches of an epoch among worker processes (disjoint).
    """
    from torch.utils.data import DataLoader

    dataset = rank_dataset(batch_size, columns=columns, shuffle=shuffle, seed=seed, drop_last=drop_last, epochs=epochs)

    class _EpochLoader(DataLoader):  # type: ignore[type-arg]
        _next_epoch = 0

        def __iter__(self) -> Any:
            self.dataset.inner.set_epoch(self._next_epoch * epochs)  # type: ignore[attr-defined]
            self._next_epoch += 1
            return super().__iter__()

    return _EpochLoader(dataset, batch_size=None, num_workers=num_workers)
