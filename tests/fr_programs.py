"""Training functions for tests/test_flight_recorder.py (shipped to ranks by value)."""

from __future__ import annotations

import time


def stuck_then_talks(seconds: float) -> int:
    """Rank 1 blocks for ``seconds`` before its all_reduce (rank 0 waits in it: a stall), then
    every rank prints a line. Returns the sum of (rank + 1) over the ranks."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://")
    rank = dist.get_rank()
    if rank == 1:
        time.sleep(seconds)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    print(f"rank {rank} talks after the stall", flush=True)
    dist.destroy_process_group()
    return int(t.item())
