"""A plain torchrun-style DDP training script: the kind of file you migrate to Spark unchanged.

It knows nothing about Spark or spark_torch. It reads the rank layout from the environment
(``init_method="env://"``: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), trains a small
classifier on scikit-learn's digits with DistributedDataParallel, and rank 0 saves a
checkpoint with ``torch.save``. Run it any of these ways:

    torchrun --nproc-per-node 2 examples/train_script.py --epochs 3 --checkpoint /tmp/ckpt.pt
    python -c "from spark_torch import Distributor; Distributor(2).run('examples/train_script.py', '--checkpoint', '/tmp/ckpt.pt')"

The checkpoint is a dict: ``model_state`` (the plain ``nn.Sequential`` state dict, without
DDP's ``module.`` prefix), ``args``, ``losses`` (mean loss per epoch over all ranks),
``world_size`` and the ``test_indices`` of the held-out rows.
"""

import argparse
import os

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def load_data(seed: int):
    x, y = load_digits(return_X_y=True)
    idx_train, idx_test = train_test_split(range(len(y)), test_size=0.2, random_state=seed, stratify=y)
    x = torch.tensor(x / 16.0, dtype=torch.float32)
    y = torch.tensor(y)
    return x, y, list(idx_train), list(idx_test)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="DDP training on the digits data set")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint", required=True, help="where rank 0 saves the checkpoint")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    dist.init_process_group("gloo", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    print(f"rank {rank}/{world} (local rank {local_rank}) on {os.uname().nodename}", flush=True)

    x, y, idx_train, idx_test = load_data(args.seed)
    train_set = TensorDataset(x[idx_train], y[idx_train])
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)

    torch.manual_seed(args.seed)
    model = DistributedDataParallel(build_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    losses = []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        total = torch.zeros(2)
        for xb, yb in loader:
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(xb), yb)
            loss.backward()
            optimizer.step()
            total += torch.tensor([loss.item() * len(yb), len(yb)])
        dist.all_reduce(total)
        losses.append((total[0] / total[1]).item())
        if rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs} loss {losses[-1]:.4f}", flush=True)

    if rank == 0:
        os.makedirs(os.path.dirname(os.path.abspath(args.checkpoint)), exist_ok=True)
        torch.save(
            {
                "model_state": model.module.state_dict(),
                "args": vars(args),
                "losses": losses,
                "world_size": world,
                "test_indices": idx_test,
            },
            args.checkpoint,
        )
        print(f"saved checkpoint to {args.checkpoint}", flush=True)
    dist.barrier()  # nobody exits before the checkpoint is written
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
