"""A DeepSpeed training script, run unchanged on Spark by ``DeepspeedTorchDistributor``.

It takes DeepSpeed's usual arguments (``--deepspeed --deepspeed_config PATH``, which the
distributor appends, as PySpark's does) and trains a tiny model built in code (nothing is
downloaded). On CPU, DeepSpeed runs with its CPU accelerator and gloo::

    from spark_torch import DeepspeedTorchDistributor

    config = {"train_batch_size": 16, "optimizer": {"type": "SGD", "params": {"lr": 0.05}}}
    DeepspeedTorchDistributor(numGpus=2, nnodes=1, localMode=True, useGpu=False,
                              deepspeedConfig=config).run("examples/deepspeed_train.py", "--steps=20")
"""

from __future__ import annotations

import argparse
import os


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--deepspeed", action="store_true")
    parser.add_argument("--deepspeed_config", default=None)
    parser.add_argument("--local_rank", type=int, default=-1)  # what the deepspeed launcher passes
    args = parser.parse_args()

    import deepspeed
    import torch

    deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=args.deepspeed_config
    )
    target = torch.nn.Linear(8, 1)
    losses = []
    for _ in range(args.steps):
        x = torch.randn(engine.train_micro_batch_size_per_gpu(), 8)
        loss = torch.nn.functional.mse_loss(engine(x), target(x).detach())
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    if int(os.environ["RANK"]) == 0:
        print(f"deepspeed: world size {torch.distributed.get_world_size()}, loss {losses[0]:.4f} -> {losses[-1]:.4f}")


if __name__ == "__main__":
    main()
