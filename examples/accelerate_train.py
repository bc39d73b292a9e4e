"""A Hugging Face Accelerate script, run unchanged on Spark.

``Accelerator()`` reads torchrun's environment that spark_torch gives every rank and prepares
the model, optimizer and data loader for DDP (gloo on CPU)::

    from spark_torch import Distributor
    Distributor(num_processes=2).run("examples/accelerate_train.py", "--epochs=2")
"""

from __future__ import annotations

import argparse


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()

    import torch
    from accelerate import Accelerator
    from torch.utils.data import DataLoader, TensorDataset

    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    torch.manual_seed(0)
    x = torch.randn(512, 8)
    y = x @ torch.arange(1.0, 9.0).unsqueeze(1)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for _ in range(args.epochs):
        for batch_x, batch_y in loader:
            loss = torch.nn.functional.mse_loss(model(batch_x), batch_y)
            optimizer.zero_grad()
            accelerator.backward(loss)
            optimizer.step()
    total = accelerator.reduce(loss.detach(), reduction="mean")
    accelerator.print(
        f"accelerate: {accelerator.num_processes} processes, distributed type {accelerator.distributed_type}, loss {total.item():.4f}"
    )


if __name__ == "__main__":
    main()
