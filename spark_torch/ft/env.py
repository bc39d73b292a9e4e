"""The replica-group variables of a rank's environment (pure: names, building and reading them).

Every rank of a run with ``replica_groups=G`` sees, besides the usual contract *within its group*
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` of its group):

=========================  =====================================================================
``REPLICA_GROUP_ID``       this rank's replica group, ``0 .. NUM_REPLICA_GROUPS-1``
``NUM_REPLICA_GROUPS``     the number of replica groups (``replica_groups``)
``TORCHFT_LIGHTHOUSE``     the address of the run's torchft lighthouse (``http://HOST:PORT``),
                           hosted by the driver; in distributed mode the node replaces it by
                           its relay's (:mod:`spark_torch.ft.node_relay`)
=========================  =====================================================================
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from spark_torch.base.envnames import NUM_REPLICA_GROUPS, REPLICA_GROUP_ID, TORCHFT_LIGHTHOUSE
from spark_torch.errors import SparkTorchError

__all__ = [
    "REPLICA_GROUP_ID",
    "NUM_REPLICA_GROUPS",
    "TORCHFT_LIGHTHOUSE",
    "NAMES",
    "GroupEnv",
    "NotInReplicaGroupError",
]

#: set for the ranks of a run with replica groups; a user's ``env=`` may not set them then
NAMES = frozenset({REPLICA_GROUP_ID, NUM_REPLICA_GROUPS, TORCHFT_LIGHTHOUSE})


class NotInReplicaGroupError(SparkTorchError, RuntimeError):
    """:func:`spark_torch.ft.manager` was called outside a rank of a run with replica groups."""


@dataclass(frozen=True)
class GroupEnv:
    """Where a rank's replica group sits in the run."""

    group: int
    groups: int
    lighthouse: str

    def variables(self) -> dict[str, str]:
        """The variables of every rank of this group."""
        return {
            REPLICA_GROUP_ID: str(self.group),
            NUM_REPLICA_GROUPS: str(self.groups),
            TORCHFT_LIGHTHOUSE: self.lighthouse,
        }

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> GroupEnv:
        """This rank's group, or NotInReplicaGroupError saying how to get one."""
        missing = sorted(name for name in NAMES if not environ.get(name))
        if missing:
            raise NotInReplicaGroupError(
                f"spark_torch.ft.manager() runs inside a rank of a run with replica groups, and "
                f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set here: start the function with "
                "Distributor(num_processes=N, replica_groups=G, ...).run(...) (docs/fault-tolerance.md)"
            )
        try:
            return cls(int(environ[REPLICA_GROUP_ID]), int(environ[NUM_REPLICA_GROUPS]), environ[TORCHFT_LIGHTHOUSE])
        except ValueError as exc:
            raise NotInReplicaGroupError(
                f"{REPLICA_GROUP_ID}={environ[REPLICA_GROUP_ID]!r} and {NUM_REPLICA_GROUPS}="
                f"{environ[NUM_REPLICA_GROUPS]!r} must be integers (set by spark_torch: do not set them yourself)"
            ) from exc
