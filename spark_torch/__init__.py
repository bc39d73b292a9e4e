"""spark_torch: run PyTorch distributed training on Apache Spark.

``from spark_torch import Distributor`` is all most users need; see :class:`Distributor`.
Importing this package is cheap: it imports neither pyspark nor torch.
"""

from spark_torch.driver.deepspeed import DeepspeedTorchDistributor
from spark_torch.driver.distributor import Distributor
from spark_torch.driver.result import Checkpoint, RunResult, load_run
from spark_torch.driver.torch_distributor import TorchDistributor
from spark_torch.errors import (
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
from spark_torch.reporting.api import get_checkpoint, report
from spark_torch.version import __version__

__all__ = [
    "Distributor",
    "TorchDistributor",
    "DeepspeedTorchDistributor",
    "RunResult",
    "Checkpoint",
    "load_run",
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
