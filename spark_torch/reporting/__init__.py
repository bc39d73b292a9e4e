"""The report()/checkpoint path, on all three sides: rank, node and driver.

Owns: :func:`spark_torch.report` and :func:`spark_torch.get_checkpoint` (rank side,
:mod:`~spark_torch.reporting.api`), the per-rank report pipes of a node
(:mod:`~spark_torch.reporting.pipes`), the driver's step coordinator that persists each step
once (:mod:`~spark_torch.reporting.coordinator`), and the run's storage of checkpoints and
metrics (:mod:`~spark_torch.reporting.storage`, any fsspec URL).
May import: the shared top-level modules only; never torch or pyspark.
"""
