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


def dies_like_the_nccl_watchdog(failing_rank: int, hang: bool = False) -> int:
    """What torch's NCCL watchdog does on a collective timeout with ``TORCH_NCCL_DUMP_ON_TIMEOUT=1``
    (which needs a GPU): write the Flight Recorder dump to ``TORCH_FR_DUMP_TEMP_FILE`` + the
    global rank, then abort the process (SIGABRT, nothing raised in Python), or with ``hang``
    block as a rank whose GPU is still busy does (torch 2.11 on an H200: the run's timeout ends
    it). The other ranks wait until they are stopped."""
    import os

    rank = int(os.environ["RANK"])
    if rank == failing_rank:
        with open(os.environ["TORCH_FR_DUMP_TEMP_FILE"] + str(rank), "wb") as fh:
            fh.write(b"a Flight Recorder dump")
        if hang:
            print("dumped; hanging", flush=True)
            time.sleep(120)
        print("dumped; aborting as the watchdog does", flush=True)
        os.abort()
    time.sleep(120)
    return rank
