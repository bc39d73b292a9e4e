"""The rank bodies of ``gpu_check.py``: what runs inside each rank on the GPU.

``gpu_check.py`` ships them by value (``cloudpickle.register_pickle_by_value``), so a rank needs
nothing but torch and spark_torch. Run as a script it is the bare-torchrun side of step f::

    torchrun --standalone --nproc_per_node=1 benchmarks/gpu_ranks.py OUT_JSON STEPS WIDTH

Every body binds its GPU the way torch's documentation asks for NCCL:
``torch.cuda.set_device(LOCAL_RANK)`` first, then ``init_process_group("nccl",
init_method="env://", device_id=torch.device("cuda", LOCAL_RANK))`` (``device_id`` binds the
group to that device and initialises its communicator at once instead of at the first
collective). ``LOCAL_RANK`` indexes the GPUs the rank sees (``CUDA_VISIBLE_DEVICES``).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

#: a spin kernel long enough to outlast any step's deadline (cycles at up to 2 GHz: ~10 min)
SPIN_CYCLES = 1_200_000_000_000


def _nccl_group(timeout_s: float | None = None) -> Any:
    """This rank's device, with the default group on NCCL bound to it."""
    import datetime

    import torch
    import torch.distributed as dist

    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    options: dict[str, Any] = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
    dist.init_process_group("nccl", init_method="env://", device_id=device, **options)
    return device


def gloo_rank() -> dict[str, Any]:
    """Step local_cpu: a gloo all_reduce, the GPUs the rank sees, who forked it."""
    import psutil
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://")
    t = torch.full((2,), float(dist.get_rank() + 1))
    dist.all_reduce(t)
    dist.destroy_process_group()
    return {
        "sum": t.tolist(),
        "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "parent": " ".join(psutil.Process(os.getppid()).cmdline()),
    }


def rank_on_gpu() -> dict[str, Any]:
    """Step a: the environment, an all_reduce of a CUDA tensor, prepare_model's device."""
    import torch
    import torch.distributed as dist

    import spark_torch

    seen = {
        k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
    }
    device = _nccl_group()
    rank = dist.get_rank()
    t = torch.full((4,), float(rank + 1), device=device)
    dist.all_reduce(t)
    value = t.tolist()  # .tolist() waits for the collective (a device-to-host copy)
    model = spark_torch.prepare_model(torch.nn.Linear(8, 8))
    out = {
        "env": seen,
        "backend": dist.get_backend(),
        "all_reduce": value,
        "device_count": torch.cuda.device_count(),
        "current_device": torch.cuda.current_device(),
        "name": torch.cuda.get_device_name(device),
        "model_device": str(next(model.parameters()).device),
        "expected_device": f"cuda:{os.environ['LOCAL_RANK']}",
    }
    dist.destroy_process_group()
    return out


def cuda_in_warm_rank() -> dict[str, Any]:
    """Step b: when the function began and when CUDA had run a matmul here; who forked this rank."""
    enter = time.time()
    import psutil
    import torch

    parent = " ".join(psutil.Process(os.getppid()).cmdline())
    x = torch.randn(1024, 1024, device="cuda")
    checksum = float((x @ x).float().sum().item())
    ready = time.time()
    return {
        "enter": enter,
        "ready": ready,
        "parent": parent,
        "initialized": torch.cuda.is_initialized(),
        "finite": checksum == checksum,
        "pid": os.getpid(),
    }


def out_of_memory(hold_bytes: int) -> None:
    """Step c: hold ``hold_bytes`` on the GPU, then ask for twice the GPU's memory."""
    import torch

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    held = torch.empty(hold_bytes, dtype=torch.uint8, device="cuda")
    held.fill_(1)
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    torch.empty(2 * total, dtype=torch.uint8, device="cuda")  # raises torch.OutOfMemoryError


def _sampled_twice(deadline_s: float = 10.0) -> int:
    """Wait until this rank's stack sampler rewrote its file twice (it has seen the caller's
    frame); returns how many rewrites were seen. A deadline names what was waited for."""
    path = os.environ["SPARK_TORCH_STACK_FILE"]
    seen, last, end = 0, None, time.monotonic() + deadline_s
    while seen < 2:
        try:
            stamp = os.stat(path).st_mtime_ns
        except FileNotFoundError:
            stamp = None
        if stamp is not None and stamp != last:
            seen, last = seen + (last is not None), stamp
        if time.monotonic() > end:
            raise TimeoutError(
                f"the stack sampler did not rewrite {path} twice in {deadline_s:g}s (SPARK_TORCH_SAMPLE_SECONDS={os.environ.get('SPARK_TORCH_SAMPLE_SECONDS')})"
            )
        time.sleep(0.02)
    return seen


def _hold_quarter(nbytes: int) -> int:
    """A frame that holds a quarter of the GPU while the sampler looks at it; returns the bytes
    allocated then."""
    import torch

    x = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    _sampled_twice()
    held = torch.cuda.memory_allocated()
    del x
    return held


def sampler_holds_no_tensor(rounds: int = 3) -> dict[str, Any]:
    """Step d: a quarter of the GPU allocated, seen by the sampler, deleted: freed at once."""
    import torch

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    free0, total = torch.cuda.mem_get_info()
    nbytes = total // 4
    base = torch.cuda.memory_allocated()
    record: dict[str, Any] = {
        "bytes": nbytes,
        "base": base,
        "rounds": [],
        "interval": os.environ.get("SPARK_TORCH_SAMPLE_SECONDS"),
    }
    for _ in range(rounds):
        x = torch.empty(nbytes, dtype=torch.uint8, device="cuda")  # deleted in this frame
        _sampled_twice()
        held = torch.cuda.memory_allocated()
        del x
        after_del = torch.cuda.memory_allocated()
        held_in_callee = _hold_quarter(nbytes)  # deleted with its frame
        after_return = torch.cuda.memory_allocated()
        y = torch.empty(nbytes, dtype=torch.uint8, device="cuda")  # the next allocation of that size
        del y
        torch.cuda.empty_cache()  # every cached block back to the driver: mem_get_info sees it
        free_after = torch.cuda.mem_get_info()[0]
        record["rounds"].append(
            {
                "held": held,
                "after_del": after_del,
                "held_in_callee": held_in_callee,
                "after_return": after_return,
                "free_after_empty_cache": free_after,
            }
        )
    record["free_before"] = free0
    return record


def stall_in_nccl() -> None:
    """Step e1: one NCCL all_reduce done, a second one queued behind a spin kernel, and the host
    waiting for the device: a stall with a NCCL collective in flight."""
    import torch
    import torch.distributed as dist

    print("FR_ENV", {k: v for k, v in os.environ.items() if k.startswith(("TORCH_FR_", "TORCH_NCCL_"))}, flush=True)
    _nccl_group()
    x = torch.ones(1024, device="cuda")
    dist.all_reduce(x)
    torch.cuda.synchronize()
    torch.cuda._sleep(SPIN_CYCLES)  # the current stream is busy: NCCL's stream waits on it
    dist.all_reduce(x)
    torch.cuda.synchronize()  # blocks here (the GIL released) until the run is stopped


def sleepy_nccl_steps(steps: int, sleep_s: float) -> int:
    """Step e3: a healthy loop whose main thread mostly sleeps between NCCL all_reduces (each
    waited for): the completed collectives are its progress, so stall detection never stops it."""
    import time

    import torch
    import torch.distributed as dist

    _nccl_group()
    x = torch.ones(1024, device="cuda")
    for _ in range(steps):
        dist.all_reduce(x)
        torch.cuda.synchronize()
        time.sleep(sleep_s)
    dist.destroy_process_group()
    return steps


def nccl_watchdog_timeout(timeout_s: float) -> None:
    """Step e2: a process group with a ``timeout_s`` collective timeout and an all_reduce that
    cannot finish in time: torch's watchdog times it out, dumps the Flight Recorder
    (TORCH_NCCL_DUMP_ON_TIMEOUT) and ends the process."""
    import torch
    import torch.distributed as dist

    print("FR_ENV", {k: v for k, v in os.environ.items() if k.startswith(("TORCH_FR_", "TORCH_NCCL_"))}, flush=True)
    _nccl_group(timeout_s)
    x = torch.ones(1024, device="cuda")
    dist.all_reduce(x)
    torch.cuda.synchronize()
    torch.cuda._sleep(SPIN_CYCLES)
    dist.all_reduce(x)
    torch.cuda.synchronize()


def ddp_steps(steps: int = 300, warmup: int | None = None, batch: int = 512, width: int = 2048) -> dict[str, Any]:
    """Step f: a DDP MLP with bf16 matmuls (autocast) on this rank's GPU; steps/s inside the loop.
    (Without CUDA: the same on the CPU with gloo, to rehearse the step's plumbing.)"""
    import torch
    import torch.distributed as dist
    from torch import nn

    cuda = torch.cuda.is_available()
    if cuda:
        device = _nccl_group()
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", init_method="env://")
    torch.manual_seed(0)
    layers = [nn.Linear(width, width), nn.GELU(), nn.Linear(width, width), nn.GELU(), nn.Linear(width, width)]
    model = nn.parallel.DistributedDataParallel(
        nn.Sequential(*layers).to(device), device_ids=[device.index] if cuda else None
    )
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(batch, width, device=device)

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()  # the GPU's queue drained: the time is the GPU's

    for _ in range(min(20, steps) if warmup is None else warmup):
        step()
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    seconds = time.perf_counter() - start
    dist.destroy_process_group()
    return {"steps_per_s": steps / seconds, "steps": steps, "seconds": seconds, "device": str(device)}


if __name__ == "__main__":  # bare torchrun: torchrun ... gpu_ranks.py OUT_JSON STEPS WIDTH
    import json

    result = ddp_steps(int(sys.argv[2]), width=int(sys.argv[3]))
    if os.environ.get("RANK", "0") == "0":
        with open(sys.argv[1], "w", encoding="utf-8") as fh:
            json.dump(result, fh)
