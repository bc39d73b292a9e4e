"""Pipeline parallelism with ``torch.distributed.pipelining``: 2 stages, GPipe schedule.

The model is cut in two: rank 0 holds the first half (stage 0), rank 1 the second half and
the loss (stage 1). Each batch is split into microbatches; ``ScheduleGPipe`` runs all forward
passes (stage 0 streams activations to stage 1 with point-to-point sends), then all backward
passes (stage 1 streams gradients back), so both ranks work at the same time on different
microbatches. Each rank steps its own optimizer on its own half.

Synthetic regression data, no download. The losses live on the last stage (rank 1); they are
sent to rank 0 with ``broadcast_object_list`` because rank 0's return value is what the
driver gets.

    python examples/pipeline_parallel.py                  # needs exactly 2 ranks
    python examples/pipeline_parallel.py --local-mode --steps 20
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

IN_FEATURES, HIDDEN, OUT_FEATURES = 8, 32, 1


def make_stage_module(stage: int) -> Any:
    """The layers of one stage (the same seed on every rank, so the split is deterministic)."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    full = nn.Sequential(
        nn.Linear(IN_FEATURES, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.ReLU(),  # stage 0
        nn.Linear(HIDDEN, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, OUT_FEATURES),  # stage 1
    )
    return full[:4] if stage == 0 else full[4:]


def train(steps: int = 20, batch_size: int = 32, microbatches: int = 4, lr: float = 0.2) -> dict[str, Any]:
    """Run on 2 ranks; rank 0 returns ``{"losses", "output_shape", "stage_params",
    "num_microbatches"}`` (``losses``: mean microbatch loss per step, from the last stage)."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    dist.init_process_group("gloo", init_method="env://")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        if world != 2:
            raise ValueError(f"this example has exactly 2 pipeline stages; run it with 2 ranks, not {world}")
        module = make_stage_module(rank)
        stage = PipelineStage(module, stage_index=rank, num_stages=world, device=torch.device("cpu"))
        schedule = ScheduleGPipe(stage, n_microbatches=microbatches, loss_fn=nn.functional.mse_loss)
        optimizer = torch.optim.SGD(module.parameters(), lr=lr)

        # every rank builds the same data; stage 0 needs the inputs, stage 1 the targets
        gen = torch.Generator().manual_seed(1)
        weights = torch.randn(IN_FEATURES, OUT_FEATURES, generator=gen)
        xs = torch.randn(4, batch_size, IN_FEATURES, generator=gen)  # a small fixed training set
        ys = torch.tanh(xs @ weights)
        losses: list[float] = []
        output_shape: list[int] = []
        for step in range(steps):
            x, y = xs[step % len(xs)], ys[step % len(ys)]
            optimizer.zero_grad()
            if stage.is_first:
                schedule.step(x)
            else:
                micro_losses: list[torch.Tensor] = []
                out = schedule.step(target=y, losses=micro_losses)
                output_shape = list(out.shape)
                losses.append(torch.stack(micro_losses).mean().item())
                if step % 5 == 0:
                    print(f"step {step} loss {losses[-1]:.4f} ({len(micro_losses)} microbatches)", flush=True)
            optimizer.step()

        stage_params = [None] * world
        dist.all_gather_object(stage_params, sum(p.numel() for p in module.parameters()))
        box = [{"losses": losses, "output_shape": output_shape}]
        dist.broadcast_object_list(box, src=world - 1)  # from the last stage to everyone
        return {**box[0], "stage_params": stage_params, "num_microbatches": microbatches}
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """Command line: run :func:`train` on 2 ranks; 0 if the loss went down."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-processes", type=int, default=2, help="number of ranks (must be 2)")
    parser.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    parser.add_argument("--local-mode", action="store_true", help="run the ranks on this machine")
    args = parser.parse_args(argv)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from spark_torch import Distributor

    result = Distributor(num_processes=args.num_processes, local_mode=args.local_mode).run(train, steps=args.steps)
    print(f"parameters per stage: {result['stage_params']}, output shape {result['output_shape']}")
    print(f"loss: {result['losses'][0]:.4f} -> {result['losses'][-1]:.4f}")
    return 0 if result["losses"][-1] < result["losses"][0] else 1


if __name__ == "__main__":
    sys.exit(main())
