"""The public API of the driver: Distributor, PySpark's TorchDistributor and DeepspeedTorchDistributor constructors,
past runs.

May import: the driver's other sub-layers (spark_torch.driver.run, spark_torch.driver.spark,
spark_torch.driver.console, spark_torch.driver.run_record, spark_torch.driver.result,
spark_torch.driver.attempts, spark_torch.driver.group_runs, spark_torch.driver.config) and what
spark_torch.driver may import (``driver-sublayers`` and ``layers`` in pyproject.toml).
"""
