"""Training functions for the Ray Train migration tests (tests/test_ray_train.py, test_runs.py)."""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Any


def ddp_with_prepare(samples: int = 16, batch_size: int = 2) -> dict[str, Any]:
    """init_process_group + prepare_model + prepare_data_loader on gloo: what every rank saw."""
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset

    import spark_torch

    spark_torch.init_process_group()
    spark_torch.init_process_group()  # a second call does nothing
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = spark_torch.prepare_model(torch.nn.Linear(1, 1))
    dataset = TensorDataset(torch.arange(samples, dtype=torch.float32).unsqueeze(1))
    loader = spark_torch.prepare_data_loader(DataLoader(dataset, batch_size=batch_size, shuffle=True))
    epochs = [[int(v) for (x,) in loader for v in x.flatten()] for _ in range(2)]
    (x,) = next(iter(loader))
    model(x).sum().backward()  # DDP all-reduces (averages) the gradients of the ranks' different inputs
    grads = [None] * world
    dist.all_gather_object(grads, [float(p.grad.sum()) for p in model.parameters()])
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    seen = [None] * world
    dist.all_gather_object(seen, epochs[0])
    out = {
        "backend": dist.get_backend(),
        "ddp": type(model).__name__,
        "device": str(next(model.parameters()).device),
        "batch_device": str(x.device),
        "batches": len(loader),
        "batch_size": loader.batch_size,
        "sampler": type(loader.sampler).__name__,
        "seen": seen,
        "epochs_differ": epochs[0] != epochs[1],
        "grads": grads,
        "sum": float(total.item()),
    }
    dist.destroy_process_group()
    return out


def report_checkpoint_objects(remote: bool = False) -> dict[str, Any]:
    """Ray Train's idiom: write a directory, report Checkpoint.from_directory(it); resume from
    get_checkpoint().as_directory(), and read the same file through every way a path worked
    before get_checkpoint() returned a Checkpoint (``/``, os.path.join + open, fspath, str,
    from_directory). ``remote``: a file:// URL checkpoint (downloaded for the upload)."""
    import spark_torch

    previous = spark_torch.get_checkpoint()
    resumed = None
    ways: dict[str, Any] = {}
    if previous is not None:
        with previous.as_directory() as directory:
            with open(os.path.join(directory, "state.txt")) as fh:
                resumed = fh.read()
        with open(os.path.join(previous, "state.txt")) as fh:
            ways["open(os.path.join)"] = fh.read()
        ways["/"] = (previous / "state.txt").read_text()
        ways["fspath"] = open(os.fspath(previous) + "/state.txt").read()
        ways["str"] = open(str(previous) + "/state.txt").read()
        with spark_torch.Checkpoint.from_directory(previous).as_directory() as directory:
            ways["from_directory"] = open(os.path.join(directory, "state.txt")).read()
        ways["type"] = type(previous).__name__
        ways["step"] = previous.step
    with tempfile.TemporaryDirectory() as tmp:
        if os.environ["RANK"] == "0":
            with open(os.path.join(tmp, "state.txt"), "w") as fh:
                fh.write(f"written by run {os.environ['SPARK_TORCH_RUN_ID']}")
        checkpoint = spark_torch.Checkpoint(f"file://{tmp}") if remote else spark_torch.Checkpoint.from_directory(tmp)
        spark_torch.report({"loss": 0.5}, checkpoint=checkpoint)
    return {
        "resumed": resumed,
        "ways": ways,
        "driver_modules": sorted(m for m in sys.modules if m.startswith("spark_torch.driver")),
    }


def context_and_device() -> list[dict[str, Any]]:
    """Every rank's get_context() and get_device() next to its torchrun variables, gathered on
    rank 0, with the driver or node modules they made the rank load (none)."""
    import torch.distributed as dist

    before = set(sys.modules)
    import spark_torch

    context = spark_torch.get_context()
    device = spark_torch.get_device()
    spark_torch.get_checkpoint()
    loaded = set(sys.modules) - before
    mine = {
        "context": [
            context.get_world_rank(),
            context.get_world_size(),
            context.get_local_rank(),
            context.get_local_world_size(),
            context.get_node_rank(),
        ],
        "env": [
            int(os.environ[name]) for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK")
        ],
        "device": str(device),
        "driver_modules": sorted(m for m in loaded if m.startswith(("spark_torch.driver", "spark_torch.node"))),
    }
    dist.init_process_group("gloo", init_method="env://")
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    dist.destroy_process_group()
    return everyone


def report_losses(losses: list[float], fail_attempts: int = 0) -> int:
    """Rank 0 checkpoints every step with ``loss``; attempts below ``fail_attempts`` fail after
    the first step."""
    import spark_torch

    attempt = int(os.environ["SPARK_TORCH_RESTART_COUNT"])
    start = spark_torch.get_checkpoint()
    done = 0 if start is None else int(open(os.path.join(start, "done.txt")).read())
    for index in range(done, len(losses)):
        with tempfile.TemporaryDirectory() as tmp:
            with open(os.path.join(tmp, "done.txt"), "w") as fh:
                fh.write(str(index + 1))
            spark_torch.report({"loss": losses[index]}, checkpoint=tmp if os.environ["RANK"] == "0" else None)
        if attempt < fail_attempts:
            raise RuntimeError(f"attempt {attempt} fails")
    return len(losses)
