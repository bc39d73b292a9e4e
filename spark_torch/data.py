"""Inside a rank started by :meth:`Distributor.run_on_dataframe`: this rank's rows as tensors.

The public home of :func:`rank_loader` and :func:`rank_dataset` (``from spark_torch.data
import rank_loader``); the code lives in :mod:`spark_torch.rank.data`, which documents how
rows are split and converted; :func:`skipped_batches`: :mod:`spark_torch.rank.step_batches`.
"""

from spark_torch.rank.data import RankDataset, rank_dataset, rank_loader
from spark_torch.rank.step_batches import skipped_batches

__all__ = ["rank_loader", "rank_dataset", "RankDataset", "skipped_batches"]
