"""Per-step fault tolerance with torchft replica groups (``Distributor(..., replica_groups=G)``).

This package owns what is torchft-specific and below the driver: the replica-group variables of a
rank's environment (:mod:`spark_torch.ft.env`), the lighthouse the driver hosts
(:mod:`spark_torch.ft.lighthouse`: hidden in a network namespace of its own,
:mod:`spark_torch.ft.hideout`, behind gates that let in only this user's connections from the
driver's machine and, in distributed mode, connections that prove the run's secret,
:mod:`spark_torch.ft.gate`, :mod:`spark_torch.ft.peers`, made by each node's relay,
:mod:`spark_torch.ft.node_relay`, all passing bytes through one thread, :mod:`spark_torch.ft.relay`), the torchft
``Manager`` wired
to the run inside a rank (:func:`manager`, :mod:`spark_torch.ft.rank`; also one the user's code
makes itself, :mod:`spark_torch.ft.wiring`; its heals unpickle plain data only,
:mod:`spark_torch.ft.safe_heal`) and the fix to torchft's DDP communication hook
(:mod:`spark_torch.ft.ddp_fix`). torchft itself is imported on first use, so spark_torch installs
and imports without it (the ``[ft]`` extra installs it). The driver's side, one attempt loop per
group, is :mod:`spark_torch.driver.api.replica_groups`. docs/fault-tolerance.md is the user's guide.

The rank layer above imports this package: its start-up installs :mod:`spark_torch.ft.wiring`.

May import: spark_torch.channel, spark_torch.reporting and the shared top-level modules; never
pyspark (``layers`` and ``no-spark-below-node`` in pyproject.toml).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from spark_torch.ft.rank import manager

__all__ = ["manager"]


def __getattr__(name: str) -> Any:
    if name == "manager":
        from spark_torch.ft.rank import manager

        return manager
    raise AttributeError(f"module 'spark_torch.ft' has no attribute {name!r}")
