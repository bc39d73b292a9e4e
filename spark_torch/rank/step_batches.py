"""A replica group's data loader, positioned by torchft's committed step.

In ``run_on_dataframe(..., replica_groups=G)`` each group trains its own rows (each of its ranks a
block of them, :class:`~spark_torch.rank.data.RankDataset`), and the groups step together: torchft's
Manager counts the steps that committed. Once the rank's Manager exists (its
:class:`~spark_torch.ft.data_position.Ledger`), a :func:`~spark_torch.data.rank_loader` hands out, at
each ``next()``, the batch of the committed step: batch ``step % batches`` of epoch
``step // batches`` (``batches`` per epoch, the same on every rank of every group), so that

- a step that torchft dropped (``should_commit()`` said no; the step did not move) is trained again
  on the same batch, and a committed batch is never handed out again;
- a group restarted alone heals at its peers' step and goes on from that step's batch of its own
  rows; the batches of the steps it missed are skipped in their epoch (the ledger counts them:
  ``skipped_batches`` in the run's rows). The batch it drew before its first quorum healed it is
  not trained: torchft zeroes a healing group's gradients (its asynchronous quorum, the default);
- one iteration (``for batch in loader``) ends when the step reaches the next epoch (or the one
  after ``epochs`` epochs), wherever the heal put it.

A loader takes one batch per step: two ``next()`` with no quorum between them (gradient
accumulation, torchft's LocalSGD and DiLoCo, an evaluation loop) raise a ``RuntimeError`` that says
to pass ``by_step=False`` to that loader (it then counts its batches, each group its own rows, as in
any run). DataLoader workers would prepare batches before the step is known: refused.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from spark_torch.ft import data_position
from spark_torch.ft.data_position import Ledger
from spark_torch.rank.positions import LoaderPosition

__all__ = ["StepBatches", "ledger_for", "check_workers", "skipped_batches"]


def skipped_batches() -> int | None:
    """In a rank of ``run_on_dataframe(..., replica_groups=G)`` whose torchft Manager exists: the
    committed steps whose batch this rank did not train (its group was down, had not started yet, or
    was healing: torchft zeroes a healing rank's gradients), counted across its group's lives; else None."""
    ledger = data_position.current()
    return ledger.mine() if ledger is not None else None


def ledger_for(by_step: bool | None) -> Ledger | None:
    """The ledger a loader follows: this rank's Manager's, unless ``by_step`` is False.

    Raises:
        RuntimeError: ``by_step=True`` and no torchft Manager was made in this rank yet.
    """
    if by_step is False:
        return None
    ledger = data_position.current()
    if ledger is None and by_step:
        raise RuntimeError(
            "rank_loader(by_step=True) hands out the batch of torchft's committed step: make the Manager "
            "(spark_torch.ft.manager(...)) before iterating the loader, in a run_on_dataframe(..., "
            "replica_groups=G) rank"
        )
    return ledger


def check_workers(num_workers: int, by_step: bool | None, in_groups: bool) -> None:
    """Workers prepare batches ahead of the step, which decides the batch.

    Raises:
        ValueError: ``num_workers`` > 0 for a loader that follows torchft's step.
    """
    if num_workers and in_groups and by_step is not False:
        raise ValueError(
            f"rank_loader(num_workers={num_workers}) in a replica group: the loader hands out the batch of "
            "torchft's committed step, which DataLoader workers cannot know ahead; pass num_workers=0 "
            "(a batch is gathered from the memory-mapped rows in the rank itself), or by_step=False to count batches "
            "as in any run"
        )


class StepBatches:
    """One loader's batches by step: ``dataset`` (a :class:`~spark_torch.rank.data.RankDataset`)
    and its ``position`` (what ``state_dict()`` and report() see)."""

    def __init__(self, dataset: Any, position: LoaderPosition) -> None:
        self.dataset = dataset
        self.position = position
        self._last: tuple[int, int] | None = None  # (step, quorums seen) of the last batch handed out

    def epoch(self, ledger: Ledger) -> int:
        """The epoch of the committed step."""
        step = ledger.current_step()
        return step // len(self.dataset) if step is not None else self.position.epoch

    def iterate(self, ledger: Ledger, epochs: int) -> Iterator[Any]:
        """The batches of the committed steps, from this step's epoch for ``epochs`` epochs."""
        per_epoch = len(self.dataset)
        step = ledger.current_step()
        end = (step // per_epoch if step is not None else 0) + epochs
        while True:
            step = ledger.current_step()
            if step is None or step // per_epoch >= end:
                return
            if self._last == (step, ledger.quorums):
                raise RuntimeError(
                    f"rank_loader: a second batch at torchft step {step} with no quorum since the first: a loader of a "
                    "replica group hands out the batch of the committed step, one per step. For several batches a "
                    "step (gradient accumulation, LocalSGD, DiLoCo) or an evaluation loader, pass by_step=False to "
                    "that loader"
                )
            self._last = (step, ledger.quorums)
            epoch, index = divmod(step, per_epoch)
            self.position.epoch, self.position.batch = epoch, index
            self.position.handed_out()
            yield self.dataset.batch_at(epoch, index)
