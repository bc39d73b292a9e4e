"""Training functions that stall (shipped to ranks by value): rank 1 waits in a function of its
own while rank 0 waits in all_reduce, the shape of the most common distributed hang."""

from __future__ import annotations

import os
import time


def wait_for_the_loader(seconds: float) -> None:
    """Rank 1's own blocking call (a stand-in for a data loader that never delivers)."""
    time.sleep(seconds)


def one_rank_stuck(seconds: float) -> int:
    """Rank 1 blocks for ``seconds`` before its all_reduce; rank 0 waits in all_reduce. Returns
    the sum of (rank + 1) over the ranks."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://")
    rank = dist.get_rank()
    if rank == 1:
        wait_for_the_loader(seconds)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    dist.destroy_process_group()
    return int(t.item())


def silent_compute(seconds: float) -> int:
    """Every rank computes in Python for ``seconds`` printing nothing, then all_reduces."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://")
    end = time.monotonic() + seconds
    total = 0
    while time.monotonic() < end:
        total += sum(i * i for i in range(2000))
    t = torch.tensor([1.0])
    dist.all_reduce(t)
    dist.destroy_process_group()
    return int(t.item())


def hold_the_gil(seconds: float) -> None:
    """A native call that keeps the GIL (ctypes.PyDLL does not release it)."""
    import ctypes

    ctypes.PyDLL(None).sleep(int(seconds))


def one_rank_holds_the_gil(seconds: float) -> int:
    """Rank 1 is in a native call holding the GIL for ``seconds``; rank 0 waits in all_reduce."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://")
    rank = dist.get_rank()
    if rank == 1:
        time.sleep(1.0)  # sampled here last: the native call below cannot be sampled
        hold_the_gil(seconds)
    t = torch.tensor([1.0])
    dist.all_reduce(t)
    dist.destroy_process_group()
    return int(t.item())


def stuck_once_after_a_checkpoint(epochs: int) -> dict[str, int]:
    """Reports a checkpoint every epoch; in the first attempt rank 1 blocks in epoch 2 forever
    (the stall detector must stop it); a restart resumes from the latest checkpoint."""
    import tempfile

    import torch
    import torch.distributed as dist

    import spark_torch

    dist.init_process_group("gloo", init_method="env://")
    rank = dist.get_rank()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    start = 0
    checkpoint = spark_torch.get_checkpoint()
    if checkpoint is not None:
        with open(os.path.join(checkpoint, "epoch.txt")) as fh:
            start = int(fh.read())
    for epoch in range(start + 1, epochs + 1):
        if attempt == 0 and epoch == 2 and rank == 1:
            wait_for_the_loader(3600)
        t = torch.ones(1)
        dist.all_reduce(t)
        with tempfile.TemporaryDirectory() as tmp:
            if rank == 0:
                with open(os.path.join(tmp, "epoch.txt"), "w") as fh:
                    fh.write(str(epoch))
            spark_torch.report({"epoch": epoch}, checkpoint=tmp if rank == 0 else None)
    dist.destroy_process_group()
    return {"resumed_from": start, "attempt": attempt}
