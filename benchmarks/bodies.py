"""Rank bodies shared by every launcher in the benchmarks (spark_torch, TorchDistributor, torchrun).

The worker (``worker_base.py``) registers this module with
``cloudpickle.register_pickle_by_value`` so both Distributors ship these functions by value;
``floor_script.py`` imports it directly (it sits next to the script, so it is on
``sys.path[0]``). Every body imports what it needs inside, like a user's training function would.
"""

from __future__ import annotations


def trivial_pg():
    """init_process_group(gloo) + one all_reduce + return; timestamps show where time went."""
    import time

    enter = time.time()
    import torch
    import torch.distributed as dist

    imported = time.time()
    dist.init_process_group("gloo", init_method="env://")
    joined = time.time()
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.destroy_process_group()
    return {"enter": enter, "imported": imported, "joined": joined, "exit": time.time(), "sum": float(t.item())}


def noop():
    """No torch, no process group: pure launch overhead."""
    import time

    return {"enter": time.time(), "exit": time.time()}


def train_ddp(steps=120, warmup=10, batch=64, dim=256, hidden=512):
    """A DDP MLP on synthetic data; returns samples/s measured inside the loop (global)."""
    import os
    import time

    import torch
    import torch.distributed as dist
    from torch import nn

    dist.init_process_group("gloo", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10)
    )
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(batch, dim, generator=gen)
    y = torch.randint(0, 10, (batch,), generator=gen)
    loss_fn = nn.CrossEntropyLoss()

    def step():
        opt.zero_grad()
        loss_fn(ddp(x), y).backward()
        opt.step()

    for _ in range(warmup):
        step()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    dist.barrier()
    elapsed = time.perf_counter() - start
    dist.destroy_process_group()
    return {
        "samples_per_s": steps * batch * world / elapsed,
        "elapsed": elapsed,
        "torch_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }


def chatter(lines=100_000):
    """Print ``lines`` lines (0: the same run, silent). Each line names its rank for counting."""
    import os
    import time

    start = time.perf_counter()
    rank = os.environ.get("RANK", "0")
    if lines:
        for i in range(lines):
            print(f"bench-line r{rank} {i}")
    return {"print_seconds": time.perf_counter() - start}


def chatter_work(lines=100_000, iters=10_000):
    """A CPU-bound loop (``iters`` steps of a 192x192 matmul, one thread) that prints ``lines``
    lines spread over its steps (0: the same loop, silent). Returns the loop's own duration:
    what logging costs a training loop, the ranks' print calls included."""
    import os
    import time

    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    rank = os.environ.get("RANK", "0")
    x = torch.randn(192, 192)
    w = torch.randn(192, 192) / 14
    per_step = lines // iters
    start = time.perf_counter()
    for i in range(iters):
        x = torch.tanh(x @ w)
        for j in range(per_step):
            print(f"bench-line r{rank} {i * per_step + j}")
    return {"loop_seconds": time.perf_counter() - start}


def big_result(nbytes=256 << 20, returned=True):
    """Rank 0 builds ``nbytes`` of bytes in touched memory (like a state dict; an untouched
    ``bytes(n)`` maps the kernel's zero page and is slow to write to a file) and returns it
    when ``returned``; the baseline run builds it too and returns None, so the difference is
    the cost of the transfer alone. Other ranks return None."""
    import os

    if os.environ.get("RANK", "0") == "0" and nbytes:
        data = os.urandom(1 << 20) * (nbytes >> 20)
        return data if returned else None
    return None


def ray_trivial(config: dict) -> None:
    """Ray Train's counterpart of trivial_pg: Ray has set up the process group."""
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
