"""A fix to torchft 0.2.0's DDP communication hook, installed by :func:`spark_torch.ft.manager`.

When a peer replica dies in the middle of an all-reduce, ``_ManagedWork.wait`` reports the error
to the Manager and returns False *before* the work's future is built, so the hook's
``assert fut._fut`` fails and the *surviving* replica crashes (torchft/ddp.py). The fixed hook
returns the bucket unchanged instead: the Manager already holds the error, ``should_commit()``
answers False and the step is dropped, as torchft intends for every other failed all-reduce.
"""

from __future__ import annotations

from typing import Any

__all__ = ["comm_hook", "install"]


def comm_hook(state: Any, bucket: Any) -> Any:
    """torchft's ``DistributedDataParallel._comm_hook``, with a failed wait answered by the
    bucket's own (unreduced) values instead of an AssertionError."""
    import torch

    work = state.allreduce(bucket.buffer())
    work.wait()
    inner = getattr(work.get_future(), "_fut", None)
    if inner is not None:
        return inner
    # the all-reduce failed (the Manager has recorded it; the step will not commit)
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.set_result(bucket.buffer())
    return done


def install() -> None:
    """Make torchft's ``DistributedDataParallel`` use :func:`comm_hook` in this process
    (idempotent; the rank's process only)."""
    import torch
    from torch.distributed import GradBucket  # type: ignore[attr-defined]
    from torchft import ddp

    def hook(state: Any, bucket: Any) -> Any:
        return comm_hook(state, bucket)

    # DDP checks a hook's annotations as objects (this module's are strings: postponed evaluation)
    hook.__annotations__ = {"state": Any, "bucket": GradBucket, "return": torch.futures.Future[torch.Tensor]}
    hook.__qualname__ = hook.__name__ = "spark_torch_comm_hook"
    ddp.DistributedDataParallel._comm_hook = staticmethod(hook)
