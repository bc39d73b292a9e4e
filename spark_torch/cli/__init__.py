"""The ``spark-torch`` command: run, doctor, runs."""

from spark_torch.cli.main import main

__all__ = ["main"]
