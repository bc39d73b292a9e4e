"""Inside a rank: Ray Train's ``get_context``, ``get_device``, ``prepare_model`` and
``prepare_data_loader`` for code that moves over.

::

    import spark_torch

    def train():
        context = spark_torch.get_context()                   # ray.train.get_context()
        print(context.get_world_rank(), "of", context.get_world_size(), "on", spark_torch.get_device())
        spark_torch.init_process_group()                      # nccl with a GPU, else gloo
        model = spark_torch.prepare_model(MyModel())          # on the rank's device, in DDP
        loader = spark_torch.prepare_data_loader(DataLoader(ds, batch_size=64, shuffle=True))
        for epoch in range(3):
            for x, y in loader:                               # this rank's share, on its device
                ...

``prepare_model`` and ``prepare_data_loader`` join the process group themselves when the
world has more than one rank; call ``init_process_group()`` first when you use
``torch.distributed`` before them. Plain ``torch.distributed`` works as well (every rank has
torchrun's environment); these are conveniences over it, nothing more. The rank's device is ``cuda:LOCAL_RANK`` when
CUDA is
available and this rank has a GPU (``LOCAL_RANK`` < the GPUs it sees), else the CPU. torch is
imported inside the functions: importing this module costs nothing.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from spark_torch.base import envnames

__all__ = [
    "RankContext",
    "get_context",
    "get_device",
    "init_process_group",
    "prepare_model",
    "prepare_data_loader",
    "rank_device",
]


@dataclass(frozen=True)
class RankContext:
    """Where this rank sits, as :func:`get_context` read it from the rank's environment
    (torchrun's variables); the ``get_*`` methods are Ray Train's ``TrainContext``'s."""

    world_rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int

    def get_world_rank(self) -> int:
        """This rank among all ranks (``RANK``)."""
        return self.world_rank

    def get_world_size(self) -> int:
        """The number of ranks (``WORLD_SIZE``)."""
        return self.world_size

    def get_local_rank(self) -> int:
        """This rank among the ranks of its node (``LOCAL_RANK``)."""
        return self.local_rank

    def get_local_world_size(self) -> int:
        """The number of ranks on this rank's node (``LOCAL_WORLD_SIZE``)."""
        return self.local_world_size

    def get_node_rank(self) -> int:
        """This rank's node (``NODE_RANK``, torchrun's ``GROUP_RANK``)."""
        return self.node_rank


_CONTEXT_VARS = (envnames.RANK, envnames.WORLD_SIZE, envnames.LOCAL_RANK, envnames.LOCAL_WORLD_SIZE)


def context_from(env: Mapping[str, str]) -> RankContext:
    """The :class:`RankContext` of the rank whose environment is ``env`` (pure)."""
    missing = [name for name in _CONTEXT_VARS if not env.get(name)]
    node = env.get(envnames.NODE_RANK) or env.get(envnames.GROUP_RANK)
    if missing or not node:
        absent = ", ".join(missing + ([] if node else [f"{envnames.NODE_RANK} (or {envnames.GROUP_RANK})"]))
        raise RuntimeError(
            "spark_torch.get_context() works inside ranks started by spark_torch (Distributor.run or "
            "spark-torch run), "
            f"whose environment has torchrun's variables; this process lacks {absent}"
        )
    values = [env[name] for name in _CONTEXT_VARS] + [node]
    try:
        rank, world, local, local_world, node_rank = (int(v) for v in values)
    except ValueError:
        raise RuntimeError(
            "spark_torch.get_context(): torchrun's variables are not integers here "
            f"({dict(zip((*_CONTEXT_VARS, 'node'), values))})"
        ) from None
    return RankContext(rank, world, local, local_world, node_rank)


def get_context() -> RankContext:
    """This rank's place in the run (Ray Train's ``ray.train.get_context()``):
    ``get_world_rank()``, ``get_world_size()``, ``get_local_rank()``, ``get_local_world_size()``,
    ``get_node_rank()``, read from the rank's environment (torchrun's ``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``NODE_RANK``/``GROUP_RANK``).

    Raises:
        RuntimeError: outside a rank (those variables are not set).
    """
    return context_from(os.environ)


def get_device() -> Any:
    """This rank's ``torch.device`` (Ray Train's ``ray.train.torch.get_device()``):
    ``cuda:LOCAL_RANK`` when CUDA is usable and the rank was given GPUs (``use_gpu``: it sees
    them in ``CUDA_VISIBLE_DEVICES``, ``LOCAL_RANK`` among them), else ``cpu``."""
    import torch

    local_rank = int(os.environ.get(envnames.LOCAL_RANK, "0"))
    if torch.cuda.is_available() and local_rank < torch.cuda.device_count():
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


#: the name prepare_model and friends use (get_device is the public one)
rank_device = get_device


def _world_size() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return int(dist.get_world_size())
    return int(os.environ.get(envnames.WORLD_SIZE, "1"))


def init_process_group(backend: str | None = None, timeout: timedelta | None = None) -> None:
    """Join this run's process group (``torch.distributed.init_process_group`` with
    ``init_method="env://"``); does nothing when the group is already initialised.

    ``backend`` defaults to ``nccl`` when this rank has a GPU (then ``cuda:LOCAL_RANK`` becomes
    the current device) and ``gloo`` otherwise. ``timeout`` is torch's collective timeout.
    """
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    device = rank_device()
    if backend is None:
        backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    options: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
    dist.init_process_group(backend, init_method="env://", **options)


def prepare_model(model: Any, **ddp_options: Any) -> Any:
    """``model`` on this rank's device, wrapped in ``DistributedDataParallel`` when the world has
    more than one rank (with ``device_ids=[LOCAL_RANK]`` on a GPU; ``ddp_options`` go to DDP).
    Joins the process group first (:func:`init_process_group`) if the rank has not."""
    import torch

    device = rank_device()
    model = model.to(device)
    if _world_size() <= 1:
        return model
    init_process_group()
    if device.type == "cuda":
        ddp_options.setdefault("device_ids", [device.index])
        ddp_options.setdefault("output_device", device.index)
    return torch.nn.parallel.DistributedDataParallel(model, **ddp_options)


def prepare_data_loader(loader: Any) -> DeviceLoader:
    """``loader`` with this rank's share of the data, its batches on this rank's device.

    With more than one rank, a new ``DataLoader`` over the same dataset draws from a
    ``DistributedSampler`` (shuffled when ``loader`` shuffled, reshuffled every epoch: the
    wrapper calls ``set_epoch`` at each new iteration) with the same ``batch_size``,
    ``num_workers``, ``collate_fn``, ``drop_last``, ``pin_memory`` and worker settings. A loader
    that already has a ``DistributedSampler``, or over an ``IterableDataset`` (which shards
    itself), is kept as it is. Joins the process group first (:func:`init_process_group`) if
    the rank has not.

    Returns:
        an iterable with ``len()``; the ``DataLoader`` is its ``loader`` attribute, and its other
        attributes (``dataset``, ``sampler``, ``batch_size``...) are the loader's.

    Raises:
        ValueError: a loader built with a ``batch_sampler`` (its batches cannot be split
            between ranks here; give each rank its share with a sampler of your own).
    """
    from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler

    device = rank_device()
    if (
        _world_size() > 1
        and not isinstance(loader.dataset, IterableDataset)
        and not isinstance(loader.sampler, DistributedSampler)
    ):
        if loader.batch_size is None:
            raise ValueError(
                "prepare_data_loader(): this DataLoader takes its batches from a batch_sampler, which cannot be split "
                "between ranks here; build it with batch_size= (and shuffle=), or give each rank its share yourself "
                "(e.g. a DistributedSampler inside your batch sampler)"
            )
        init_process_group()  # the sampler asks the group for this rank and the world size
        sampler: Any = DistributedSampler(
            loader.dataset, shuffle=isinstance(loader.sampler, RandomSampler), drop_last=loader.drop_last
        )
        options: dict[str, Any] = {
            "batch_size": loader.batch_size,
            "sampler": sampler,
            "num_workers": loader.num_workers,
            "collate_fn": loader.collate_fn,
            "drop_last": loader.drop_last,
            "pin_memory": loader.pin_memory,
            "timeout": loader.timeout,
            "worker_init_fn": loader.worker_init_fn,
            "multiprocessing_context": loader.multiprocessing_context,
        }
        if loader.num_workers > 0:
            options.update(prefetch_factor=loader.prefetch_factor, persistent_workers=loader.persistent_workers)
        loader = DataLoader(loader.dataset, **options)
    return DeviceLoader(loader, device)


def _to(batch: Any, device: Any) -> Any:
    """``batch`` (tensors in lists, tuples, dicts, at any depth) on ``device``."""
    if hasattr(batch, "to") and callable(batch.to) and type(batch).__module__.startswith("torch"):
        return batch.to(device, non_blocking=device.type == "cuda")
    if isinstance(batch, dict):
        return {key: _to(value, device) for key, value in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(_to(value, device) for value in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to(value, device) for value in batch)
    return batch


class DeviceLoader:
    """What :func:`prepare_data_loader` returns: iterates the ``loader``'s batches on ``device``."""

    def __init__(self, loader: Any, device: Any) -> None:
        self.loader = loader
        self.device = device
        self._epoch = 0

    def __iter__(self) -> Iterator[Any]:
        set_epoch = getattr(self.loader.sampler, "set_epoch", None)
        if callable(set_epoch):  # a DistributedSampler shuffles differently each epoch only when told
            set_epoch(self._epoch)
        self._epoch += 1
        for batch in self.loader:
            yield _to(batch, self.device)

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        if name == "loader":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.loader, name)
