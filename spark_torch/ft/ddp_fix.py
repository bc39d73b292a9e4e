"""torchft 0.2.0's per-step path in a rank, fixed and made cheaper (:func:`install`, called for every Manager).

**The DDP communication hook** (:func:`comm_hook`). torchft's hook waits for each bucket's
all-reduce before it returns, so nothing of the backward pass overlaps the all-reduce (plain DDP's
does), and when a peer replica dies in the middle of one, ``_ManagedWork.wait`` reports the error to
the Manager and returns False *before* the work's future is built: the hook's ``assert fut._fut``
fails and the *surviving* replica crashes (torchft/ddp.py). The hook here returns at once a future
of the process group's all-reduce that averages the bucket when it completes (what torchft's
callback does), so the backward pass goes on meanwhile, as with plain DDP; when the all-reduce
fails it records the error with the Manager and answers the bucket's own (unreduced) values:
``should_commit()`` answers False and the step is dropped, as torchft intends for every other
failed all-reduce. On a GPU (a CUDA buffer, torchft's stream handling) and where torchft's work is
not the one it knows, it waits as torchft does, with the same fix.

**A one-rank group's commit** (:func:`solo_should_commit`). ``Manager.should_commit()`` asks the
group's Manager server (a gRPC round trip, even in the server's own process) whether every rank of
the group may commit; for a group of one rank the server's answer is that rank's own vote
(torchft's ``manager.rs``: the decision is that no rank of the group voted no). In a group of one
rank, the Manager's client answers it locally; every other check of ``should_commit()`` (errors,
healing, enough replicas, the step count) is torchft's, unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

__all__ = ["comm_hook", "blocking_hook", "install", "SoloCommitClient", "solo_should_commit"]

#: set on a wrapped ``Manager.should_commit`` (wrapping twice would be harmless but wasteful)
_MARK = "_spark_torch_solo_commit"


def _done(value: Any) -> Any:
    import torch

    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(value)
    return future


def blocking_hook(state: Any, bucket: Any) -> Any:
    """torchft's ``DistributedDataParallel._comm_hook`` (it waits for the all-reduce), with a failed
    wait answered by the bucket's own (unreduced) values instead of an AssertionError."""
    work = state.allreduce(bucket.buffer())
    work.wait()
    inner = getattr(work.get_future(), "_fut", None)
    if inner is not None:
        return inner
    # the all-reduce failed (the Manager has recorded it; the step will not commit)
    return _done(bucket.buffer())


def comm_hook(state: Any, bucket: Any) -> Any:
    """The bucket's all-reduce through the Manager (``state``), returned as a future without
    waiting: averaged over the quorum's participants when it completes, the bucket unchanged
    (and the error with the Manager) when it fails. See the module's docstring."""
    buffer = bucket.buffer()
    if buffer.is_cuda:
        return blocking_hook(state, bucket)
    work = state.allreduce(buffer)  # waits for the quorum, zeroes a healing replica's buffer, starts the all-reduce
    inner = getattr(work, "_work", None)  # torchft's _ManagedWork around the process group's work
    if inner is None:  # torchft's _DummyWork: the Manager had already errored, nothing was sent
        return _done(buffer)
    participants = state.num_participants()  # what torchft's own callback divides by
    try:
        started = inner.get_future()
    except Exception as exc:  # noqa: BLE001 - whatever the process group raises drops the step
        state.report_error(exc)
        return _done(buffer)

    def averaged(future: Any) -> Any:
        try:
            future.value()
        except Exception as exc:  # noqa: BLE001 - the step is dropped, not the process
            state.report_error(exc)
            return buffer
        return buffer.div_(participants)

    return started.then(averaged)


class SoloCommitClient:
    """A one-rank group's ``ManagerClient``: ``should_commit`` is answered with the rank's own vote
    (what the group's Manager server answers for one rank), everything else goes to ``client``."""

    def __init__(self, client: Any) -> None:
        self._client = client

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def should_commit(self, group_rank: int, step: int, should_commit: bool, timeout: Any = None) -> bool:
        """The rank's vote: in a group of one rank, the group's decision."""
        return bool(should_commit)


def solo_should_commit(original: Callable[..., bool]) -> Callable[..., bool]:
    """``Manager.should_commit`` that, in a group of one rank, gives the Manager a
    :class:`SoloCommitClient` before torchft's own ``should_commit`` runs."""
    if getattr(original, _MARK, False):
        return original

    @functools.wraps(original)
    def should_commit(self: Any, *args: Any, **kwargs: Any) -> bool:
        client = getattr(self, "_client", None)
        if getattr(self, "_group_world_size", None) == 1 and client is not None:
            if not isinstance(client, SoloCommitClient):
                self._client = SoloCommitClient(client)
        return original(self, *args, **kwargs)

    setattr(should_commit, _MARK, True)
    return should_commit


def install() -> None:
    """Make torchft's ``DistributedDataParallel`` use :func:`comm_hook` and its ``Manager`` answer
    a one-rank group's commit locally, in this process (idempotent; the rank's process only)."""
    import torch
    import torchft.manager as torchft_manager
    from torch.distributed import GradBucket  # type: ignore[attr-defined]
    from torchft import ddp

    def hook(state: Any, bucket: Any) -> Any:
        return comm_hook(state, bucket)

    # DDP checks a hook's annotations as objects (this module's are strings: postponed evaluation)
    hook.__annotations__ = {"state": Any, "bucket": GradBucket, "return": torch.futures.Future[torch.Tensor]}
    hook.__qualname__ = hook.__name__ = "spark_torch_comm_hook"
    ddp.DistributedDataParallel._comm_hook = staticmethod(hook)
    manager = torchft_manager.Manager
    manager.should_commit = solo_should_commit(manager.should_commit)
