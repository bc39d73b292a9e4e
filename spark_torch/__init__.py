"""spark_torch: run PyTorch distributed training on Apache Spark.

``from spark_torch import Distributor`` is all most users need; see :class:`Distributor`.
Importing this package is cheap: it imports neither pyspark nor torch, and each public name is
imported on first use (a rank's entry module loads none of the driver's modules).
"""

import importlib
from typing import TYPE_CHECKING, Any

from spark_torch.version import __version__

if TYPE_CHECKING:  # what the lazy names below resolve to, for type checkers and IDEs
    from spark_torch.driver.api.deepspeed import DeepspeedTorchDistributor
    from spark_torch.driver.api.distributor import Distributor
    from spark_torch.driver.api.past_runs import RunSummary, list_runs
    from spark_torch.driver.api.torch_distributor import TorchDistributor
    from spark_torch.driver.result import (
        AttemptEnd,
        AttemptError,
        AttemptReason,
        AttemptRecord,
        AttemptSize,
        GrowRequest,
        RunResult,
        SizeReason,
    )
    from spark_torch.errors import (
        ArgumentError,
        ClusterConfigurationError,
        ConfigurationError,
        DistributedRunError,
        InsufficientSlotsError,
        LaunchError,
        PicklingError,
        RankFailure,
        ReplicaGroupError,
        RunStalledError,
        RunTimeoutError,
        SparkTorchError,
        StoppedRank,
    )
    from spark_torch.rank.prepare import (
        RankContext,
        get_context,
        get_device,
        init_process_group,
        prepare_data_loader,
        prepare_model,
    )
    from spark_torch.reporting.api import get_checkpoint, report
    from spark_torch.reporting.checkpoint import Checkpoint
    from spark_torch.shared.spec import GpuFallback, LaunchPlan

#: where each public name lives; imported on first access (module ``__getattr__``, PEP 562)
_HOMES = {
    "Distributor": "spark_torch.driver.api.distributor",
    "TorchDistributor": "spark_torch.driver.api.torch_distributor",
    "DeepspeedTorchDistributor": "spark_torch.driver.api.deepspeed",
    "RunResult": "spark_torch.driver.result",
    "Checkpoint": "spark_torch.reporting.checkpoint",
    "AttemptRecord": "spark_torch.driver.result",
    "AttemptEnd": "spark_torch.driver.result",
    "AttemptReason": "spark_torch.driver.result",
    "AttemptSize": "spark_torch.driver.result",
    "SizeReason": "spark_torch.driver.result",
    "AttemptError": "spark_torch.driver.result",
    "GrowRequest": "spark_torch.driver.result",
    "LaunchPlan": "spark_torch.shared.spec",
    "GpuFallback": "spark_torch.shared.spec",
    "list_runs": "spark_torch.driver.api.past_runs",
    "RunSummary": "spark_torch.driver.api.past_runs",
    "init_process_group": "spark_torch.rank.prepare",
    "prepare_model": "spark_torch.rank.prepare",
    "prepare_data_loader": "spark_torch.rank.prepare",
    "get_context": "spark_torch.rank.prepare",
    "get_device": "spark_torch.rank.prepare",
    "RankContext": "spark_torch.rank.prepare",
    "report": "spark_torch.reporting.api",
    "get_checkpoint": "spark_torch.reporting.api",
    "SparkTorchError": "spark_torch.errors",
    "ConfigurationError": "spark_torch.errors",
    "ClusterConfigurationError": "spark_torch.errors",
    "InsufficientSlotsError": "spark_torch.errors",
    "PicklingError": "spark_torch.errors",
    "ArgumentError": "spark_torch.errors",
    "LaunchError": "spark_torch.errors",
    "DistributedRunError": "spark_torch.errors",
    "RunTimeoutError": "spark_torch.errors",
    "RunStalledError": "spark_torch.errors",
    "ReplicaGroupError": "spark_torch.errors",
    "RankFailure": "spark_torch.errors",
    "StoppedRank": "spark_torch.errors",
}

__all__ = [
    "Distributor",
    "TorchDistributor",
    "DeepspeedTorchDistributor",
    "RunResult",
    "Checkpoint",
    "AttemptRecord",
    "AttemptEnd",
    "AttemptReason",
    "AttemptSize",
    "SizeReason",
    "AttemptError",
    "GrowRequest",
    "LaunchPlan",
    "GpuFallback",
    "list_runs",
    "RunSummary",
    "init_process_group",
    "prepare_model",
    "prepare_data_loader",
    "get_context",
    "get_device",
    "RankContext",
    "report",
    "get_checkpoint",
    "SparkTorchError",
    "ConfigurationError",
    "ClusterConfigurationError",
    "InsufficientSlotsError",
    "PicklingError",
    "ArgumentError",
    "LaunchError",
    "DistributedRunError",
    "RunTimeoutError",
    "RunStalledError",
    "ReplicaGroupError",
    "RankFailure",
    "StoppedRank",
    "__version__",
]


#: names kept for old code, not in ``__all__`` (each warns when called)
_DEPRECATED = {"load_run": "spark_torch.driver.api.past_runs"}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name) or _DEPRECATED.get(name)
    if home is None:
        raise AttributeError(f"module 'spark_torch' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # the next access is a plain attribute
    return value


def __dir__() -> "list[str]":
    return sorted(__all__)
