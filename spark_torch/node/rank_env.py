"""Build the environment of one rank (pure). The contract is documented in :mod:`spark_torch.rank.function_main`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from spark_torch.base import envnames as names

__all__ = ["RankIdentity", "rank_env"]


@dataclass(frozen=True)
class RankIdentity:
    """Where a rank sits in the world."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    num_nodes: int


def rank_env(
    base: Mapping[str, str],
    identity: RankIdentity,
    *,
    master_addr: str,
    master_port: int,
    run_id: str,
    restart_count: int = 0,
    max_restarts: int = 0,
    threads: int | None = 1,
    cuda_visible_devices: str | None = None,
    extra: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The full environment of one rank: ``base`` minus secrets, plus torchrun's variables."""
    env = {k: v for k, v in base.items() if k not in names.SCRUBBED}
    # Spark pins OMP_NUM_THREADS=1 for Python tasks; give each rank its share of the cores
    # instead, unless the user (``extra``, or the driver's environment in local mode) or the
    # cluster (spark.executorEnv) chose a value: then ``threads`` is None.
    if threads is not None:
        for var in names.THREAD_VARS:
            env[var] = str(threads)
    env["PYTHONUNBUFFERED"] = "1"
    # what torchrun sets: a failed NCCL collective raises instead of hanging
    env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    if cuda_visible_devices is not None:
        env[names.CUDA_VISIBLE_DEVICES] = cuda_visible_devices
    if extra:
        env.update(extra)
    if names.REPLICA_GROUP_ID in env:
        # torchft's Rust side logs every quorum at INFO (several lines a step): warnings only,
        # unless the user (``extra``, the driver's or the executor's environment) chose a filter
        env.setdefault(names.RUST_LOG, names.RUST_LOG_DEFAULT)
    env.update(
        {
            names.RANK: str(identity.rank),
            names.LOCAL_RANK: str(identity.local_rank),
            names.WORLD_SIZE: str(identity.world_size),
            names.LOCAL_WORLD_SIZE: str(identity.local_world_size),
            names.NODE_RANK: str(identity.node_rank),
            names.GROUP_RANK: str(identity.node_rank),
            names.GROUP_WORLD_SIZE: str(identity.num_nodes),
            names.ROLE_RANK: str(identity.rank),
            names.ROLE_WORLD_SIZE: str(identity.world_size),
            names.ROLE_NAME: "default",
            names.MASTER_ADDR: master_addr,
            names.MASTER_PORT: str(master_port),
            names.TORCHELASTIC_RUN_ID: run_id,
            names.TORCHELASTIC_RESTART_COUNT: str(restart_count),
            names.TORCHELASTIC_MAX_RESTARTS: str(max_restarts),
            names.RUN_ID: run_id,
            names.RESTART_COUNT: str(restart_count),
        }
    )
    return env
