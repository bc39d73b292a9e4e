"""spark_torch: run PyTorch distributed training on Apache Spark.

``from spark_torch import Distributor`` is all most users need; see :class:`Distributor`.
Importing this package is cheap: it imports neither pyspark nor torch.
"""

from .distributor import Distributor
from .errors import (
    ConfigurationError,
    DistributedRunError,
    InsufficientSlotsError,
    LaunchError,
    PicklingError,
    RankFailure,
    RunTimeoutError,
    SparkTorchError,
)

__version__ = "0.1.0"

__all__ = [
    "Distributor",
    "SparkTorchError",
    "ConfigurationError",
    "InsufficientSlotsError",
    "PicklingError",
    "LaunchError",
    "DistributedRunError",
    "RunTimeoutError",
    "RankFailure",
    "__version__",
]
