"""Build the environment of one rank (pure). The contract is documented in :mod:`spark_torch.rank.function_main`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["RankIdentity", "rank_env", "SCRUBBED_ENV"]

# Variables of the Spark Python worker or driver that must not reach user code: Spark's own
# secrets (``_SPARK_AUTH_SECRET`` is set for executors and their Python workers when
# spark.authenticate is on; the Py4J gateway and worker-factory secrets; a Spark Connect token),
# the ports they protect, and a torchrun agent's store from an outer launcher.
SCRUBBED_ENV = frozenset(
    {
        "_SPARK_AUTH_SECRET",
        "PYSPARK_GATEWAY_SECRET",
        "PYSPARK_GATEWAY_PORT",
        "PYTHON_WORKER_FACTORY_SECRET",
        "PYTHON_WORKER_FACTORY_PORT",
        "SPARK_CONNECT_AUTHENTICATE_TOKEN",
        "TORCHELASTIC_USE_AGENT_STORE",
    }
)

THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


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
    env = {k: v for k, v in base.items() if k not in SCRUBBED_ENV}
    # Spark pins OMP_NUM_THREADS=1 for Python tasks; give each rank its share of the cores
    # instead, unless the user (``extra``, or the driver's environment in local mode) or the
    # cluster (spark.executorEnv) chose a value: then ``threads`` is None.
    if threads is not None:
        for var in THREAD_VARS:
            env[var] = str(threads)
    env["PYTHONUNBUFFERED"] = "1"
    # what torchrun sets: a failed NCCL collective raises instead of hanging
    env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    if cuda_visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices
    if extra:
        env.update(extra)
    env.update(
        {
            "RANK": str(identity.rank),
            "LOCAL_RANK": str(identity.local_rank),
            "WORLD_SIZE": str(identity.world_size),
            "LOCAL_WORLD_SIZE": str(identity.local_world_size),
            "NODE_RANK": str(identity.node_rank),
            "GROUP_RANK": str(identity.node_rank),
            "GROUP_WORLD_SIZE": str(identity.num_nodes),
            "ROLE_RANK": str(identity.rank),
            "ROLE_WORLD_SIZE": str(identity.world_size),
            "ROLE_NAME": "default",
            "MASTER_ADDR": master_addr,
            "MASTER_PORT": str(master_port),
            "TORCHELASTIC_RUN_ID": run_id,
            "TORCHELASTIC_RESTART_COUNT": str(restart_count),
            "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
            "SPARK_TORCH_RUN_ID": run_id,
            "SPARK_TORCH_RESTART_COUNT": str(restart_count),
        }
    )
    return env
