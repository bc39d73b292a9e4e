"""Where each data loader of this rank is in its epochs, so that a resumed run goes on after the
batch its checkpoint was reported at (same epoch, same shuffle order) instead of training the
epoch's first rows twice.

- Every :func:`~spark_torch.rank.data.rank_loader` / :func:`~spark_torch.rank.data.rank_dataset`
  gets a :class:`LoaderPosition`: the epoch and the batch (within the epoch) it hands out next.
  A batch counts once the loader has handed it to the training loop (as in torchdata's
  ``StatefulDataLoader``): report() after training on a batch records the batch after it.
- :func:`~spark_torch.report` sends every position of the rank, in the order the rank made its
  loaders (:mod:`spark_torch.reporting.loader_positions`); the driver keeps them with the
  step's checkpoint.
- A loader made in a rank that resumes from a checkpoint takes the position the rank's loader
  of the same creation order had. When the world size, the DataFrame's rows (their
  count or their split over nodes) or the batching (batch size, shuffle, seed, drop_last)
  differ from the checkpoint's, the position does not apply: the loader warns and starts that
  epoch again from its first batch, on every rank alike (every rank sees the same world and
  rows, so they keep the same number of batches and DDP stays in step).
"""

from __future__ import annotations

import hashlib
import json
import threading
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

from spark_torch.reporting import loader_positions

__all__ = ["LoaderPosition", "Tracker", "fingerprint", "register", "positions", "forget"]

#: what must be the same for a saved position to apply, in the order a warning names them (not the
#: rank: in the same world a rank whose own position was not kept takes a peer's, which DDP kept in step)
KEYS = ("world_size", "rows", "layout", "batches", "batch_size", "shuffle", "seed", "drop_last", "window")


def fingerprint(
    *, world_size: int, rank: int, rows: list[int], local_world_size: int, batches: int, **batching: Any
) -> dict[str, Any]:
    """What a position depends on: the world, the rows per node (``rows``), how they are batched."""
    layout = hashlib.sha256(json.dumps([rows, local_world_size]).encode()).hexdigest()[:16]
    return {"world_size": world_size, "rank": rank, "rows": sum(rows), "layout": layout, "batches": batches, **batching}


class LoaderPosition:
    """The epoch and the batch within it that one loader hands out next (``batches`` per epoch)."""

    def __init__(self, key: dict[str, Any]) -> None:
        self.key = dict(key)
        self.batches = int(key["batches"])
        self.epoch = 0
        self.batch = 0

    def handed_out(self) -> None:
        """One more batch went to the training loop."""
        self.batch += 1
        if self.batch >= self.batches:
            self.epoch, self.batch = self.epoch + 1, 0

    def move_to(self, epoch: int) -> None:
        """The next batch is the first of ``epoch``."""
        self.epoch, self.batch = epoch, 0

    def skip(self, first: int, epochs: int) -> int:
        """How many batches an iteration over epochs ``first`` .. ``first + epochs - 1`` skips:
        up to this position when it lies in them, else none (the position moves to ``first``)."""
        if first <= self.epoch < first + epochs:
            return (self.epoch - first) * self.batches + self.batch
        self.move_to(first)
        return 0

    def state_dict(self) -> dict[str, Any]:
        """The position, with what it depends on (JSON)."""
        return {"epoch": self.epoch, "batch": self.batch, **self.key}

    def load_state_dict(self, state: Any, origin: str = "load_state_dict()") -> None:
        """Go on from ``state`` (a :meth:`state_dict`); one made for another world, other rows or
        other batching restarts its epoch from the first batch, with a warning.

        Raises:
            ValueError: ``state`` is not a position (names what it needs).
        """
        epoch = state.get("epoch") if isinstance(state, dict) else None
        batch = state.get("batch") if isinstance(state, dict) else None
        if (
            not (isinstance(epoch, int) and isinstance(batch, int))
            or isinstance(epoch, bool)
            or isinstance(batch, bool)
            or min(epoch, batch) < 0
        ):
            raise ValueError(
                f"{origin}: {state!r:.200} is not a data loader's position; pass what the loader's state_dict() "
                "returned "
                "(a dict with int 'epoch' and 'batch' >= 0)"
            )
        changed = [(k, state.get(k), self.key[k]) for k in KEYS if k in self.key and state.get(k) != self.key[k]]
        if changed:
            what = "; ".join(f"{k} {old!r} -> {new!r}" for k, old, new in changed[:3])
            warnings.warn(
                f"spark_torch: the data loader's position from {origin} (epoch {epoch}, batch {batch}) was recorded "
                f"for another run's data or world ({what}): epoch {epoch} starts again from its first batch, so "
                "some of its rows are trained twice",
                UserWarning,
                stacklevel=3,
            )
            self.move_to(epoch)
            return
        self.epoch, self.batch = epoch, batch
        if self.batch >= self.batches > 0:
            self.move_to(self.epoch + 1)


_lock = threading.Lock()
#: weak: a loader that is gone (one made per epoch) keeps its number, as None, and nothing else
_made: list[weakref.ref[LoaderPosition]] = []


def register(position: LoaderPosition) -> LoaderPosition:
    """Number ``position`` in creation order; in a resumed rank, start it where the checkpoint's
    loader of that number was."""
    with _lock:
        index = len(_made)
        _made.append(weakref.ref(position))
        if len(_made) == 1:
            loader_positions.track(positions)
    saved = loader_positions.saved()
    if saved is not None and index < len(saved) and saved[index] is not None:
        position.load_state_dict(saved[index], origin="the checkpoint this run resumes from")
    return position


def positions() -> list[dict[str, Any] | None]:
    """Every loader's position in this rank, in creation order, None for one that is gone (what report() sends)."""
    with _lock:
        alive = [ref() for ref in _made]
    return [p.state_dict() if p is not None else None for p in alive]


def forget() -> None:
    """Forget the loaders made so far (tests: a new rank, as it were)."""
    with _lock:
        _made.clear()


class Tracker:
    """A loader's :class:`LoaderPosition` and its open iteration: the open one counts the
    batches it hands out; one left early (``break``), or replaced by a newer ``iter()``, leaves
    the position at the end of its epochs, where the next iteration starts."""

    def __init__(self, position: LoaderPosition) -> None:
        self.position = position
        self._open: object | None = None
        self._end = 0

    def end_open(self) -> None:
        """An iteration begins: the one still open (if any) ends here."""
        if self._open is not None:
            self._open = None
            self.position.move_to(self._end)

    def open(self, first: int, epochs: int) -> int:
        """Open an iteration over epochs ``first`` .. ``first + epochs - 1``; the batches it skips."""
        self.end_open()
        self._end = first + epochs
        return self.position.skip(first, epochs)

    def count(self, batches: Iterator[Any]) -> Iterator[Any]:
        """``batches``, the iteration just opened, each counted as it is handed out."""
        token = self._open = object()
        finished = False
        try:
            for batch in batches:
                if self._open is token:
                    self.position.handed_out()
                yield batch
            finished = True
        finally:
            if self._open is token:
                self._open = None
                if not finished:
                    self.position.move_to(self._end)
