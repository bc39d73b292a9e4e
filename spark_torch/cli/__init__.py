"""The ``spark-torch`` command: run, doctor, runs.

May import: every layer below it (the top of ``layers`` in pyproject.toml).
"""

from spark_torch.cli.main import main

__all__ = ["main"]
