"""Distributed data-parallel training of a small MLP on scikit-learn's digits, on Spark.

Every rank runs :func:`train`: it joins a gloo process group (``env://``: spark_torch sets
RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), trains its shard of the training set
(``DistributedSampler``) with the gradients averaged by ``DistributedDataParallel``, and
rank 0's return value comes back to the driver.

    python examples/ddp_digits.py                      # 2 ranks, one Spark barrier task each
    python examples/ddp_digits.py --num-processes 4 --epochs 20
    python examples/ddp_digits.py --local-mode         # ranks as processes on the driver

With no active SparkSession, ``Distributor(local_mode=False)`` starts an embedded ``local[*]``
one. The digits data ships with scikit-learn; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

ACCURACY_THRESHOLD = 0.9


def train(epochs: int = 10, lr: float = 0.05, batch_size: int = 32, seed: int = 0) -> dict[str, Any]:
    """Train on this rank; return ``{"test_accuracy", "losses", "world_size"}`` (same on every rank).

    ``losses`` holds one mean training loss per epoch, averaged over all ranks.
    """
    import torch
    import torch.distributed as dist
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    from sklearn.preprocessing import StandardScaler
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.distributed import DistributedSampler

    dist.init_process_group("gloo", init_method="env://")
    try:
        rank = dist.get_rank()
        world_size = dist.get_world_size()

        # The same split and scaling on every rank (fixed seed); the sampler shards the rows.
        x, y = load_digits(return_X_y=True)
        x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)
        scaler = StandardScaler().fit(x_train)
        x_train = torch.tensor(scaler.transform(x_train), dtype=torch.float32)
        x_test = torch.tensor(scaler.transform(x_test), dtype=torch.float32)
        y_train = torch.tensor(y_train, dtype=torch.long)
        y_test = torch.tensor(y_test, dtype=torch.long)

        dataset = TensorDataset(x_train, y_train)
        sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed)
        loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)

        torch.manual_seed(seed)  # DDP also broadcasts rank 0's initial weights
        model = DistributedDataParallel(
            nn.Sequential(
                nn.Linear(x_train.shape[1], 128),
                nn.ReLU(),
                nn.Linear(128, 64),
                nn.ReLU(),
                nn.Linear(64, 10),
            )
        )
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        loss_fn = nn.CrossEntropyLoss(reduction="sum")

        losses: list[float] = []
        for epoch in range(1, epochs + 1):
            sampler.set_epoch(epoch)
            model.train()
            # [sum of losses, correct, samples] on this rank, summed over ranks below
            stats = torch.zeros(3, dtype=torch.float64)
            for xb, yb in loader:
                optimizer.zero_grad()
                logits = model(xb)
                loss = loss_fn(logits, yb)
                (loss / len(yb)).backward()
                optimizer.step()
                stats += torch.tensor(
                    [loss.item(), (logits.argmax(1) == yb).sum().item(), len(yb)], dtype=torch.float64
                )
            dist.all_reduce(stats)
            epoch_loss = (stats[0] / stats[2]).item()
            losses.append(epoch_loss)
            if rank == 0:
                train_acc = (stats[1] / stats[2]).item()
                print(f"epoch {epoch} loss {epoch_loss:.4f} train_acc {train_acc:.4f}", flush=True)

        # Each rank scores a disjoint slice of the test set; the counts are summed.
        model.eval()
        with torch.no_grad():
            xs, ys = x_test[rank::world_size], y_test[rank::world_size]
            correct = (model(xs).argmax(1) == ys).sum().item() if len(ys) else 0
        counts = torch.tensor([correct, len(ys)], dtype=torch.float64)
        dist.all_reduce(counts)
        test_accuracy = (counts[0] / counts[1]).item()
        return {"test_accuracy": test_accuracy, "losses": losses, "world_size": world_size}
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """Command line: run :func:`train` with a :class:`~spark_torch.Distributor`; 0 if accuracy > 0.9."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-processes", type=int, default=2, help="number of ranks (default 2)")
    parser.add_argument("--epochs", type=int, default=10, help="training epochs (default 10)")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default 0.05)")
    parser.add_argument("--batch-size", type=int, default=32, help="batch size per rank (default 32)")
    parser.add_argument("--seed", type=int, default=0, help="split/shuffle/init seed (default 0)")
    parser.add_argument(
        "--local-mode",
        action="store_true",
        help="run the ranks as processes on this machine instead of on Spark barrier tasks",
    )
    args = parser.parse_args(argv)

    # The embedded Spark session (started by Distributor when none is active) binds to loopback.
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from spark_torch import Distributor

    distributor = Distributor(num_processes=args.num_processes, local_mode=args.local_mode)
    start = time.monotonic()
    result = distributor.run(train, epochs=args.epochs, lr=args.lr, batch_size=args.batch_size, seed=args.seed)
    elapsed = time.monotonic() - start
    accuracy = result["test_accuracy"]
    print(f"world size: {result['world_size']}, run time: {elapsed:.1f}s")
    print(f"test accuracy: {accuracy:.3f}")
    if accuracy <= ACCURACY_THRESHOLD:
        print(f"test accuracy {accuracy:.3f} is not above {ACCURACY_THRESHOLD}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
