"""The public API of the driver: Distributor, PySpark's TorchDistributor and DeepspeedTorchDistributor constructors, past runs.

May import: the driver's other sub-layers (run, spark, console, config, result) and what the
driver may import (``driver-sublayers`` and ``layers`` in pyproject.toml).
"""
