"""Inside a rank started by :meth:`Distributor.run_on_dataframe`: this rank's rows as tensors.

The node runner writes the node's share of the DataFrame to a folder of column files
(:mod:`spark_torch.shared.column_files`, ``SPARK_TORCH_DATA_FILE``); rank ``LOCAL_RANK`` of the node
owns one contiguous block of it, so each row belongs to exactly one rank. A rank reads its
epoch a window at a time (:mod:`spark_torch.rank.windows`: about 32 MiB of rows read into memory,
never mapped; shuffled, a two-level shuffle) and gathers each batch's rows from its window: a
rank holds one window and one batch, never its whole shard, and a batch costs the same whatever
the number of rows.

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

A run resumed from a ``report()`` checkpoint goes on after the batch the checkpoint was
reported at, every row once per epoch (:mod:`spark_torch.rank.positions`). With replica groups
(``NUM_REPLICA_GROUPS``) each node's rows are split over every group's ranks (group ``g``'s local
rank ``r`` owns block ``g * LOCAL_WORLD_SIZE + r``): each group trains its own rows, and a loader
hands out the batch of torchft's committed step (:mod:`spark_torch.rank.step_batches`).

Column types (:mod:`spark_torch.rank.columns`): integer/float/bool scalars -> 1-D tensors;
arrays of numbers -> 2-D tensors (fixed length) or lists of 1-D tensors (ragged); Spark ML
vectors (dense or sparse) -> 2-D tensors; strings -> lists of str; binary -> lists of bytes.
Floating-point arrays and vectors are float32 unless ``dtype`` says otherwise (:func:`rank_loader`).

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

from spark_torch.base import envnames
from spark_torch.rank import step_batches
from spark_torch.rank.columns import column_dtypes, column_kind, float_columns, to_tensor
from spark_torch.rank.positions import LoaderPosition, Tracker, fingerprint, register
from spark_torch.rank.tracked_dataset import make_iterable_dataset
from spark_torch.rank.windows import Windows, window_rows
from spark_torch.shared.column_files import StagedColumns

__all__ = [
    "rank_dataset",
    "rank_loader",
    "RankDataset",
    "column_kind",
    "rank_positions",
]


def _shares(rows_per_node: Sequence[int], local_world_size: int) -> list[int]:
    return [len(range(j, rows, local_world_size)) for rows in rows_per_node for j in range(local_world_size)]


def rank_positions(
    node_rows: int, local_rank: int, local_world_size: int, rows_per_node: Sequence[int] | None, drop_last: bool
) -> list[int]:
    """The row positions (in this node's file) one rank iterates per epoch (pure; a list, for
    tests and readers: :class:`RankDataset` computes the same positions batch by batch).

    Its own rows are one contiguous block of the node's file: the node's rows split into
    ``local_world_size`` blocks in local-rank order, the first ``node_rows % local_world_size``
    one row longer (so each rank touches only its own pages of the memory-mapped file); with
    ``rows_per_node`` (every node's row count) they are padded by wrapping around
    (``drop_last=False``) or cut (``drop_last=True``) to the count every rank of the world gets.
    """
    sharding = _Sharding(node_rows, local_rank, local_world_size, rows_per_node, drop_last)
    return [int(p) for p in sharding.positions(range(sharding.count))]


class _Sharding:
    """One rank's rows as arithmetic: the j-th row of its epoch (0 <= j < count) is at file
    position ``first + (j mod own)``, ``first`` being where its block starts (see :func:`rank_positions`)."""

    def __init__(
        self,
        node_rows: int,
        local_rank: int,
        local_world_size: int,
        rows_per_node: Sequence[int] | None,
        drop_last: bool,
    ) -> None:
        self.node_rows = node_rows
        base, longer = divmod(node_rows, local_world_size)
        self.own = base + (local_rank < longer)
        self.first = local_rank * base + min(local_rank, longer)
        if not rows_per_node or not self.own:
            self.count = self.own
        else:
            shares = _shares(rows_per_node, local_world_size)
            self.count = min(self.own, min(shares)) if drop_last else max(shares)

    def positions(self, js: Any) -> Any:
        import numpy as np

        js = np.asarray(js, dtype=np.int64)
        if self.count > self.own:
            js = js % self.own
        return self.first + js


class RankDataset:
    """An ``IterableDataset`` of this rank's rows, yielding whole batches.

    Each iteration is one epoch (or ``epochs`` epochs back to back); with ``shuffle``, the
    order is seeded by ``seed`` and the epoch number, so it differs per epoch and is
    reproducible (a two-level shuffle over windows: :mod:`spark_torch.rank.windows`). With DataLoader workers, each
    worker yields a disjoint set of batches.
    ``path`` is a folder staged by :class:`~spark_torch.shared.column_files.ColumnWriter`; ``dtype``:
    see :func:`rank_loader`. A batch costs the same whatever the number of rows: its rows'
    positions are computed, then gathered from the window of rows read last.
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
        dtype: Any = None,
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
        groups = int(os.environ.get(envnames.NUM_REPLICA_GROUPS) or 1)  # every group's ranks split the rows
        group = int(os.environ.get(envnames.REPLICA_GROUP_ID) or 0) if groups > 1 else 0
        self.slot, self.slots = group * self.local_world_size + self.local_rank, groups * self.local_world_size
        staged = StagedColumns(path)
        names = list(columns) if columns is not None else staged.names
        missing = [c for c in names if c not in staged.columns]
        if missing:
            raise KeyError(f"columns {missing} are not in the data (available: {staged.names})")
        self.columns = names
        self.as_tuple = as_tuple
        self.kinds: dict[str, str] = {name: staged.columns[name]["kind"] for name in names}
        self.dtypes = column_dtypes(self.kinds, float_columns(staged.columns, names), dtype)
        self._sharding = _Sharding(staged.rows, self.slot, self.slots, self.rows_per_node, drop_last)
        self._staged: StagedColumns | None = None  # opened in the process that iterates (workers)
        self._step_windows: Windows | None = None  # batch_at's windows (a replica group's loader)
        #: batches the next iteration leaves out at its start (a resumed position: :mod:`spark_torch.rank.positions`)
        self.skip = 0

    def __len__(self) -> int:
        """Batches per epoch on this rank (before splitting among DataLoader workers)."""
        rows = self.num_rows()
        return rows // self.batch_size if self.drop_last else -(-rows // self.batch_size)

    def num_rows(self) -> int:
        """Rows this rank iterates per epoch (the same on every rank: see the module docstring)."""
        return int(self._sharding.count)

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch whose shuffle order the next iteration uses."""
        self.epoch = epoch

    def __getstate__(self) -> dict[str, Any]:
        # DataLoader workers map the files themselves
        return {**self.__dict__, "_staged": None, "_step_windows": None}

    def _batch(self, rows: StagedColumns, indices: Any) -> Any:
        values = [to_tensor(rows.gather(name, indices), self.kinds[name], self.dtypes[name]) for name in self.columns]
        if self.as_tuple:
            return tuple(values)
        return dict(zip(self.columns, values))

    def window_rows(self) -> int:
        """Rows this rank reads into memory at once (:mod:`spark_torch.rank.windows`)."""
        staged = StagedColumns(self.path) if self._staged is None else self._staged
        return window_rows(staged.row_bytes(self.columns), self.batch_size, self._sharding.count)

    def __iter__(self) -> Iterator[Any]:
        return self._batches(self.skip)  # skip read now: a generator would read it at its first batch

    def _batches(self, skip: int) -> Iterator[Any]:
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        count, per_epoch = self._sharding.count, len(self)
        stop = count - (count % self.batch_size if self.drop_last else 0)
        if self._staged is None:
            self._staged = StagedColumns(self.path)
        windows = Windows(self._staged, self.columns, self._sharding, self.window_rows(), self.shuffle, self.seed)
        # the iteration's batches numbered on across its epochs, from the first not skipped (a
        # resumed position): worker w takes every workers-th from there, so a DataLoader, which
        # takes one from each worker in turn, hands them out in order
        for k in range(skip, per_epoch * self.epochs):
            if (k - skip) % workers != worker:
                continue
            epoch, index = divmod(k, per_epoch)
            start = index * self.batch_size
            yield self._batch(*windows.batch(self.epoch + epoch, start, min(start + self.batch_size, stop)))

    def batch_at(self, epoch: int, index: int) -> Any:
        """Batch ``index`` of epoch ``epoch``, as an iteration yields it (a replica group's loader
        takes the committed step's: :mod:`spark_torch.rank.step_batches`)."""
        if self._staged is None:
            self._staged = StagedColumns(self.path)
        if self._step_windows is None:
            self._step_windows = Windows(
                self._staged, self.columns, self._sharding, self.window_rows(), self.shuffle, self.seed
            )
        count = self._sharding.count
        start, stop = index * self.batch_size, count - (count % self.batch_size if self.drop_last else 0)
        return self._batch(*self._step_windows.batch(epoch, start, min(start + self.batch_size, stop)))

    def position_key(self) -> dict[str, Any]:
        """What a saved position of this dataset depends on (:func:`spark_torch.rank.positions.fingerprint`)."""
        return fingerprint(
            world_size=int(os.environ.get(envnames.WORLD_SIZE, "1")),
            rank=int(os.environ.get(envnames.RANK, "0")),
            rows=self.rows_per_node or [self._sharding.node_rows],
            local_world_size=self.slots,
            batches=len(self),
            batch_size=self.batch_size,
            shuffle=bool(self.shuffle),
            seed=self.seed,
            drop_last=bool(self.drop_last),
            window=self.window_rows() if self.shuffle else 0,  # a shuffled epoch's order depends on it
        )


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
    dtype: Any = None,
    by_step: bool | None = None,
) -> Any:
    """This rank's rows as a ``torch.utils.data.IterableDataset`` that yields whole batches.

    Batches are dicts of column name -> tensor (or list), or tuples in ``columns`` order when
    columns were given here or to ``run_on_dataframe``. ``dtype``: see :func:`rank_loader`.
    Iterated in the rank's process, a resumed run's dataset goes on as :func:`rank_loader` does
    (its epoch: the checkpoint's), and in a replica group follows torchft's step (``by_step``: see
    :func:`rank_loader`); in your own DataLoader's worker processes it can do neither.
    """
    return _rank_dataset(batch_size, columns, shuffle, seed, drop_last, epochs, dtype, tracked=True, by_step=by_step)


def _rank_dataset(
    batch_size: int,
    columns: Sequence[str] | None,
    shuffle: bool,
    seed: int,
    drop_last: bool,
    epochs: int,
    dtype: Any,
    tracked: bool,
    by_step: bool | None = None,
) -> Any:
    cols, as_tuple = _default_columns(columns)
    inner = RankDataset(
        _data_file(),
        batch_size=batch_size,
        columns=cols,
        as_tuple=as_tuple,
        shuffle=shuffle,
        seed=seed,
        drop_last=drop_last,
        epochs=epochs,
        dtype=dtype,
    )
    if not tracked:
        return make_iterable_dataset(inner, None)
    tracker = Tracker(register(LoaderPosition(inner.position_key())))
    inner.set_epoch(tracker.position.epoch)  # a resumed one: its epoch
    return make_iterable_dataset(inner, tracker, by_step)


def rank_loader(
    batch_size: int,
    *,
    columns: Sequence[str] | None = None,
    shuffle: bool = False,
    seed: int = 0,
    drop_last: bool = False,
    num_workers: int = 0,
    epochs: int = 1,
    dtype: Any = None,
    by_step: bool | None = None,
) -> Any:
    """A ``DataLoader`` over this rank's rows; each ``iter()`` is the next epoch (``loader.epoch``:
    the epoch of its next batch).

    ``shuffle`` reorders rows per epoch from ``seed`` (reproducible); ``num_workers`` > 0
    splits the batches of an epoch among worker processes (disjoint, handed out in order).

    In a run resumed from a ``report(checkpoint=...)`` checkpoint the loader goes on after the
    batch that checkpoint was reported at, in the same epoch and shuffle order
    (:mod:`spark_torch.rank.positions`); ``state_dict()`` and ``load_state_dict()`` do the same
    for checkpoints made by hand.

    ``dtype``: by default floating-point arrays and Spark ML vectors arrive as ``float32``
    (what ``torch.nn`` modules hold) and other columns as their Spark type (double ->
    float64, long -> int64, boolean -> bool). One torch dtype (``dtype=torch.float64``)
    applies to every floating-point column and every vector; a dict
    (``dtype={"label": torch.float32}``) sets the columns it names, numeric ones only.

    In ``run_on_dataframe(..., replica_groups=G)``, once the rank made its torchft Manager, each
    ``next()`` hands out the batch of torchft's committed step (one batch per step;
    :mod:`spark_torch.rank.step_batches`); ``by_step=False`` counts batches as in any run (an
    evaluation loader), ``True`` requires the Manager.
    """
    from torch.utils.data import DataLoader

    step_batches.check_workers(num_workers, by_step, bool(os.environ.get(envnames.REPLICA_GROUP_ID)))
    dataset = _rank_dataset(batch_size, columns, shuffle, seed, drop_last, epochs, dtype, tracked=False)
    tracker = Tracker(register(LoaderPosition(dataset.inner.position_key())))
    steps = step_batches.StepBatches(dataset.inner, tracker.position)

    class _EpochLoader(DataLoader):  # type: ignore[type-arg]
        @property
        def epoch(self) -> int:
            """The epoch of the next batch (a resumed loader's: where its checkpoint was; a replica group's: the
            step's)."""
            ledger = step_batches.ledger_for(by_step)
            return steps.epoch(ledger) if ledger is not None else tracker.position.epoch

        def __iter__(self) -> Any:
            tracker.end_open()
            ledger = step_batches.ledger_for(by_step)
            if ledger is not None:  # a replica group: the committed step's batch
                return steps.iterate(ledger, epochs)
            first = tracker.position.epoch // epochs * epochs
            inner = self.dataset.inner  # type: ignore[attr-defined]
            inner.set_epoch(first)
            inner.skip = tracker.open(first, epochs)
            try:  # the workers start here, with their copy of the dataset
                return tracker.count(super().__iter__())
            finally:
                inner.skip = 0

        def state_dict(self) -> dict[str, Any]:
            """Where this loader is: the epoch and the batch it hands out next, and what they depend
            on (JSON). spark_torch saves it with every report() checkpoint by itself; this is for
            checkpoints made by hand."""
            return tracker.position.state_dict()

        def load_state_dict(self, state: dict[str, Any]) -> None:
            """Go on from ``state`` (a :meth:`state_dict`) at the next ``iter()``. A state recorded
            for another world size, rank, DataFrame or batching restarts its epoch, with a warning.

            Raises:
                ValueError: ``state`` is not a loader's state.
            """
            tracker.end_open()
            tracker.position.load_state_dict(state)

    return _EpochLoader(dataset, batch_size=None, num_workers=num_workers)
