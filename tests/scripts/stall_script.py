"""A training script whose rank 1 blocks before all_reduce (stall detection by script path)."""

import time

import torch
import torch.distributed as dist


def wait_for_the_loader(seconds: float) -> None:
    time.sleep(seconds)


dist.init_process_group("gloo", init_method="env://")
if dist.get_rank() == 1:
    wait_for_the_loader(3600)
t = torch.ones(1)
dist.all_reduce(t)
dist.destroy_process_group()
