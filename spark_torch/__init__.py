"""spark_torch: run PyTorch distributed training on Apache Spark.

``from spark_torch import Distributor`` is all most users need; see :class:`Distributor`.
Importing this package is cheap: it imports neither pyspark nor torch.
"""

from .distributor import Distributor
from .errors import (
    ClusterConfigurationError,
    ConfigurationError,
    DistributedRunError,
    InsufficientSlotsError,
    LaunchError,
    PicklingError,
    RankFailure,
    RunTimeoutError,
    SparkTorchError,
)
from .reporting import get_checkpoint, report
from .result import RunResult
from .torch_distributor import TorchDistributor

__version__ = "0.1.0"

__all__ = [
    "Distributor",
    "TorchDistributor",
    "RunResult",
    "report",
    "get_checkpoint",
    "SparkTorchError",
    "ConfigurationError",
    "ClusterConfigurationError",
    "InsufficientSlotsError",
    "PicklingError",
    "LaunchError",
    "DistributedRunError",
    "RunTimeoutError",
    "RankFailure",
    "__version__",
]
