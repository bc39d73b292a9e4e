"""What :func:`~spark_torch.data.rank_dataset` returns: a ``torch.utils.data.IterableDataset`` over a
:class:`~spark_torch.rank.data.RankDataset` that, iterated in the rank's process, counts the batches it
hands out (:mod:`spark_torch.rank.positions`: a resumed run goes on after its checkpoint's batch),
or in a replica group hands out the batch of torchft's committed step
(:mod:`spark_torch.rank.step_batches`). In a DataLoader's worker processes it can do neither, and warns.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

from spark_torch.rank import step_batches
from spark_torch.rank.positions import Tracker

__all__ = ["make_iterable_dataset"]


def make_iterable_dataset(dataset: Any, tracker: Tracker | None, by_step: bool | None = None) -> Any:
    """``dataset`` as an ``IterableDataset``; ``tracker`` None: a rank_loader's (the loader counts);
    ``by_step``: see :func:`~spark_torch.data.rank_loader`."""
    from torch.utils.data import IterableDataset, get_worker_info

    class _Iterable(IterableDataset):  # type: ignore[type-arg]
        """``rank_dataset()``: iterated in the rank's process, it counts its batches (``tracker``)."""

        def __init__(self, inner: Any, tracker: Tracker | None) -> None:
            self.inner = inner
            self.tracker = tracker  # None: a rank_loader's dataset (the loader counts)
            self.steps = step_batches.StepBatches(inner, tracker.position) if tracker is not None else None

        def __iter__(self) -> Iterator[Any]:
            if self.tracker is None:
                return iter(self.inner)
            info = get_worker_info()
            if info is not None:
                if info.id == 0:  # a worker is a new process each iteration: it cannot know it warned before
                    warnings.warn(_UNTRACKED, UserWarning, stacklevel=2)
                return iter(self.inner)
            ledger = step_batches.ledger_for(by_step)
            if ledger is not None and self.steps is not None:  # a replica group: the committed step's batch
                self.tracker.end_open()
                return self.steps.iterate(ledger, self.inner.epochs)
            self.inner.skip = self.tracker.open(self.inner.epoch, self.inner.epochs)
            try:
                return self.tracker.count(iter(self.inner))
            finally:
                self.inner.skip = 0

        def __len__(self) -> int:
            return len(self.inner)

        def state_dict(self) -> dict[str, Any]:
            """Where this dataset is (see :func:`rank_loader`'s ``state_dict``)."""
            return _tracker(self).position.state_dict()

        def load_state_dict(self, state: dict[str, Any]) -> None:
            """Go on from ``state`` (see :func:`rank_loader`'s ``load_state_dict``); also sets the epoch."""
            tracker = _tracker(self)
            tracker.end_open()
            tracker.position.load_state_dict(state)
            self.inner.set_epoch(tracker.position.epoch)

    return _Iterable(dataset, tracker)


def _tracker(dataset: Any) -> Tracker:
    if dataset.tracker is None:
        raise RuntimeError(
            "this dataset belongs to a rank_loader(): use the loader's state_dict() and load_state_dict()"
        )
    return dataset.tracker  # type: ignore[no-any-return]


_UNTRACKED = (
    "spark_torch: a rank_dataset() iterated in your own DataLoader's worker processes cannot record its position for "
    "a resumed run (a run resumed from a checkpoint starts its epoch again); use rank_loader(num_workers=...) instead"
)
