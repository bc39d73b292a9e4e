"""Inside a rank: a torchft ``Manager`` wired to the run (:func:`manager`)."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

from spark_torch.base.envnames import MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE
from spark_torch.ft import wiring
from spark_torch.ft.env import GroupEnv, NotInReplicaGroupError
from spark_torch.ft.install import install_hint
from spark_torch.ft.wiring import bind_address, replica_id

__all__ = ["manager", "bind_address", "replica_id"]

#: what the Manager's server and the gloo process group wait for by default (torchft's is 60 s)
DEFAULT_TIMEOUT = timedelta(seconds=60)


def _group(environ: Mapping[str, str]) -> tuple[GroupEnv, int, int, str, int]:
    """The rank's group, its rank and size in the group, and the group's store."""
    group = GroupEnv.from_environ(environ)
    try:
        return group, int(environ[RANK]), int(environ[WORLD_SIZE]), environ[MASTER_ADDR], int(environ[MASTER_PORT])
    except (KeyError, ValueError) as exc:
        raise NotInReplicaGroupError(
            f"spark_torch.ft.manager() needs {RANK}, {WORLD_SIZE}, {MASTER_ADDR} and {MASTER_PORT} as spark_torch sets "
            f"them for a rank ({exc!r}); call it inside the function that Distributor(..., replica_groups=G).run() "
            "starts"
        ) from exc


def manager(
    *,
    state_dict: Callable[[], Any],
    load_state_dict: Callable[[Any], None],
    min_replica_size: int = 1,
    timeout: timedelta = DEFAULT_TIMEOUT,
    device: Any = None,
    **kwargs: Any,
) -> Any:
    """A torchft ``Manager`` for this rank's replica group, wired to the run.

    Call it inside the function of a ``Distributor(num_processes=N, replica_groups=G)`` run, then
    wrap the model with torchft's ``DistributedDataParallel`` and the optimizer with its
    ``Optimizer`` (docs/fault-tolerance.md)::

        from spark_torch import ft
        from torchft import DistributedDataParallel, Optimizer

        mgr = ft.manager(state_dict=lambda: {"model": model.state_dict(), "optim": opt.state_dict()},
                         load_state_dict=lambda s: (model.load_state_dict(s["model"]), opt.load_state_dict(s["optim"])))
        model, opt = DistributedDataParallel(mgr, model), Optimizer(mgr, opt)

    What it sets: the group's store (``MASTER_ADDR``/``MASTER_PORT`` of the group, on the node's
    address: hosted by the node, or by the group's rank 0 before the user's code when the node
    did not, :mod:`spark_torch.rank.store`), a reconfigurable gloo process group (NCCL
    when ``device`` is a CUDA device), the lighthouse (``TORCHFT_LIGHTHOUSE``), the replica id of
    the group (``REPLICA_GROUP_ID``), the Manager's server bound to the node's address (torchft
    binds every interface), healing over that process group (torchft's ``PGTransport``; torchft's
    default is an HTTP server on every interface), torchft's per-step path fixed and made cheaper
    (:mod:`spark_torch.ft.ddp_fix`: a DDP hook that does not wait for the all-reduce and survives a
    lost peer, a one-rank group's commit without a round trip), and :func:`spark_torch.report`'s step: from then on it
    records the Manager's ``current_step()`` (a call at a step already reported is skipped), so
    a restarted group that healed from a peer reports no step twice. ``kwargs`` go to ``torchft.Manager`` and win
    over these
    (``pg``, ``checkpoint_transport``, ``use_async_quorum``, ``quorum_timeout``...).

    Raises:
        NotInReplicaGroupError (a RuntimeError): outside a rank of a run with replica groups.
        ModuleNotFoundError: torchft is not installed (the message says how: :mod:`spark_torch.ft.install`).
    """
    group, rank, world_size, host, port = _group(os.environ)
    try:
        import torch
        import torchft
        from torchft.checkpointing.pg_transport import PGTransport
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(f"spark_torch.ft.manager() needs torchft ({exc}): {install_hint()}") from exc
    import torchft.manager as torchft_manager

    wiring.wire(torchft_manager)  # the DDP hook fix, the server's address, report()'s step: as for any Manager here
    dev = torch.device(device) if device is not None else torch.device("cpu")
    pg = kwargs.pop("pg", None)
    if pg is None:
        pg = (
            torchft.ProcessGroupNCCL(timeout=timeout)
            if dev.type == "cuda"
            else torchft.ProcessGroupGloo(timeout=timeout)
        )
    options: dict[str, Any] = {
        "pg": pg,
        "state_dict": state_dict,
        "load_state_dict": load_state_dict,
        "min_replica_size": min_replica_size,
        "timeout": timeout,
        "rank": rank,
        "world_size": world_size,
        "store_addr": host,
        "store_port": port,
        "lighthouse_addr": group.lighthouse,
        "replica_id": replica_id(group.group),
        "hostname": host,
        "checkpoint_transport": PGTransport(pg, timeout=timeout, device=dev),
        **kwargs,
    }
    return torchft.Manager(**options)
