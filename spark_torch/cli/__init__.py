"""The ``spark-torch`` command: run, doctor, runs.

May import: every layer below it (the top of ``layers`` in pyproject.toml): spark_torch.driver,
spark_torch.node, spark_torch.rank, spark_torch.ft, spark_torch.channel, spark_torch.reporting and the
shared top-level modules.
"""

from spark_torch.cli.main import main

__all__ = ["main"]
