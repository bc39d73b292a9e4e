"""Synchronous SGD by hand: the training example of PyTorch's distributed tutorial, on Spark.

No ``DistributedDataParallel``: each rank trains on its own partition of the data (a seeded
``DataPartitioner``, so every rank computes the same shuffle and takes a disjoint slice), and
after every backward pass ``average_gradients`` all-reduces the gradients and divides by the
world size. The models start equal (same seed) and stay equal because every rank applies
the same averaged gradient. Data: scikit-learn's digits (bundled, nothing is downloaded).

    python examples/sync_sgd.py
    python examples/sync_sgd.py --num-processes 4 --epochs 5 --local-mode
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from typing import Any


class Partition:
    """A view of ``data`` restricted to ``index``."""

    def __init__(self, data: Any, index: list[int]) -> None:
        self.data, self.index = data, index

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> Any:
        return self.data[self.index[i]]


class DataPartitioner:
    """Shuffle the indices with a fixed seed, then cut them into ``sizes`` fractions."""

    def __init__(self, data: Any, sizes: list[float], seed: int = 1234) -> None:
        self.data = data
        rng = random.Random(seed)  # the same permutation on every rank
        indexes = list(range(len(data)))
        rng.shuffle(indexes)
        self.partitions: list[list[int]] = []
        for fraction in sizes:
            part_len = int(fraction * len(data))
            self.partitions.append(indexes[:part_len])
            indexes = indexes[part_len:]

    def use(self, partition: int) -> Partition:
        return Partition(self.data, self.partitions[partition])


def average_gradients(model: Any) -> None:
    """All-reduce every gradient and divide by the world size."""
    import torch.distributed as dist

    size = float(dist.get_world_size())
    for param in model.parameters():
        dist.all_reduce(param.grad.data, op=dist.ReduceOp.SUM)
        param.grad.data /= size


def train(epochs: int = 3, lr: float = 0.1, batch_size: int = 128, seed: int = 1234) -> dict[str, Any]:
    """Run on every rank; rank 0 returns ``{"losses", "accuracy", "partition_sizes", "in_sync"}``.

    ``losses`` is the per-epoch mean loss averaged over ranks, ``accuracy`` the accuracy of
    the (identical) final model on the whole data set, ``in_sync`` whether all ranks ended
    with bit-identical weights.
    """
    import torch
    import torch.distributed as dist
    from sklearn.datasets import load_digits
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    dist.init_process_group("gloo", init_method="env://")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(seed)
        x, y = load_digits(return_X_y=True)
        dataset = TensorDataset(torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y))

        # the global batch is split between ranks, like in the tutorial
        partition = DataPartitioner(dataset, [1.0 / world] * world, seed=seed).use(rank)
        loader = DataLoader(partition, batch_size=batch_size // world, shuffle=True)

        model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        losses: list[float] = []
        for epoch in range(epochs):
            total = torch.zeros(2)
            for xb, yb in loader:
                optimizer.zero_grad()
                loss = nn.functional.cross_entropy(model(xb), yb)
                loss.backward()
                average_gradients(model)
                optimizer.step()
                total += torch.tensor([loss.item(), 1.0])
            dist.all_reduce(total)
            losses.append((total[0] / total[1]).item())
            print(f"rank {rank} epoch {epoch}: {len(partition)} samples, mean loss {losses[-1]:.4f}", flush=True)

        with torch.no_grad():
            xs, ys = dataset.tensors
            accuracy = (model(xs).argmax(1) == ys).float().mean().item()
            flat = torch.cat([p.detach().flatten() for p in model.parameters()])
        copies = [torch.zeros_like(flat) for _ in range(world)]
        dist.all_gather(copies, flat)
        sizes: list[Any] = [None] * world
        dist.all_gather_object(sizes, len(partition))
        return {
            "losses": losses,
            "accuracy": accuracy,
            "partition_sizes": sizes,
            "in_sync": all(torch.equal(c, flat) for c in copies),
        }
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """Command line: run :func:`train` and print the losses and the accuracy."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-processes", type=int, default=2, help="number of ranks (default 2)")
    parser.add_argument("--epochs", type=int, default=3, help="epochs (default 3)")
    parser.add_argument("--lr", type=float, default=0.1, help="learning rate (default 0.1)")
    parser.add_argument("--local-mode", action="store_true", help="run the ranks on this machine")
    args = parser.parse_args(argv)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from spark_torch import Distributor

    result = Distributor(num_processes=args.num_processes, local_mode=args.local_mode).run(
        train, epochs=args.epochs, lr=args.lr
    )
    print(f"partition sizes: {result['partition_sizes']}, models in sync: {result['in_sync']}")
    print(f"losses: {[round(v, 4) for v in result['losses']]}")
    print(f"accuracy: {result['accuracy']:.3f}")
    return 0 if result["in_sync"] else 1


if __name__ == "__main__":
    sys.exit(main())
