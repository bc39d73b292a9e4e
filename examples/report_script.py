"""A torchrun-style DDP training script that reports metrics and checkpoints to spark_torch.

It trains a small classifier on scikit-learn's digits with DistributedDataParallel. Each epoch
it calls ``spark_torch.report()`` with the epoch's mean loss and test accuracy and a checkpoint
(model and optimizer state), and on start it resumes from ``spark_torch.get_checkpoint()``.
Under plain torchrun (no ``SPARK_TORCH_RUN_ID`` in the environment) it trains without
reporting. Run it any of these ways:

    spark-torch run -n 2 --storage-path /tmp/runs --run-id digits examples/report_script.py --epochs 3
    python -c "from spark_torch import Distributor; Distributor(2, storage_path='/tmp/runs').run('examples/report_script.py')"
    torchrun --nproc-per-node 2 examples/report_script.py --epochs 3
"""

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import spark_torch

UNDER_SPARK_TORCH = "SPARK_TORCH_RUN_ID" in os.environ


def main(argv=None):
    parser = argparse.ArgumentParser(description="DDP on digits, reporting to spark_torch")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=0.1)
    args = parser.parse_args(argv)
    dist.init_process_group("gloo", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32)
    y = torch.tensor(y)
    train = TensorDataset(x[:1400], y[:1400])
    sampler = DistributedSampler(train, num_replicas=world, rank=rank, seed=0)
    loader = DataLoader(train, batch_size=32, sampler=sampler)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=args.lr)

    start = 0
    checkpoint = spark_torch.get_checkpoint()
    if checkpoint is not None:
        state = torch.load(checkpoint / "state.pt")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["epoch"] + 1
        print(f"rank {rank}: resuming after epoch {state['epoch']}", flush=True)

    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        total = torch.zeros(2)
        for xb, yb in loader:
            loss = nn.functional.cross_entropy(ddp(xb), yb)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += torch.tensor([loss.item() * len(yb), len(yb)])
        dist.all_reduce(total)
        with torch.no_grad():
            accuracy = (model(x[1400:]).argmax(1) == y[1400:]).float().mean().item()
        mean_loss = (total[0] / total[1]).item()
        if rank == 0:
            print(f"epoch {epoch}: loss {mean_loss:.4f} test accuracy {accuracy:.3f}", flush=True)
        if UNDER_SPARK_TORCH:
            with tempfile.TemporaryDirectory() as tmp:
                if rank == 0:
                    torch.save(
                        {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch},
                        f"{tmp}/state.pt",
                    )
                spark_torch.report({"loss": mean_loss, "accuracy": accuracy, "epoch": epoch}, checkpoint=tmp)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
