"""Fully Sharded Data Parallel (FSDP) training of a tiny transformer, on CPU with gloo.

``torch.distributed.fsdp.FullyShardedDataParallel`` shards every parameter, gradient and
optimizer state across the ranks: each rank stores ``1/N`` of the model, and the full
weights of a layer exist only while that layer runs (all-gathered before forward/backward,
gradients reduce-scattered after). Here each transformer layer is its own FSDP unit.

The task is synthetic and needs no download: predict, at every position, the token that
came before it in a random sequence (a copy-shifted-by-one task a transformer learns in a few
dozen steps). At the end the full (unsharded) state dict is gathered on rank 0 only
(``StateDictType.FULL_STATE_DICT`` with ``rank0_only=True``), and rank 0 returns its
parameter count together with the losses.

    python examples/fsdp_transformer.py
    python examples/fsdp_transformer.py --steps 60 --local-mode
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from typing import Any

VOCAB = 16
SEQ_LEN = 12


def make_model(d_model: int = 32, layers: int = 2) -> Any:
    """A small causal-free transformer encoder with token + position embeddings."""
    import torch
    from torch import nn

    class TinyTransformer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(VOCAB, d_model)
            self.pos = nn.Parameter(torch.randn(SEQ_LEN, d_model) * 0.02)
            self.layers = nn.ModuleList(
                nn.TransformerEncoderLayer(d_model, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True)
                for _ in range(layers)
            )
            self.head = nn.Linear(d_model, VOCAB)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            h = self.embed(tokens) + self.pos
            for layer in self.layers:
                h = layer(h)
            return self.head(h)

    return TinyTransformer()


def train(steps: int = 40, lr: float = 3e-3, batch_size: int = 16, seed: int = 0) -> dict[str, Any]:
    """Run on every rank; rank 0 returns ``{"num_params", "losses", "first_loss", "final_loss",
    "state_dict_keys", "shard_numel"}`` (``shard_numel``: parameters stored on each rank)."""

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    warnings.filterwarnings("ignore", category=FutureWarning)  # FSDP1 points to fully_shard
    warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed.fsdp")
    dist.init_process_group("gloo", init_method="env://")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(seed)  # the same initial weights everywhere (FSDP also syncs them)
        model = FSDP(
            make_model(),
            auto_wrap_policy=ModuleWrapPolicy({nn.TransformerEncoderLayer}),
            device_id=torch.device("cpu"),
            use_orig_params=True,
        )
        shard_numel = sum(p.numel() for p in model.parameters())
        optimizer = torch.optim.Adam(model.parameters(), lr=lr)

        data_gen = torch.Generator().manual_seed(seed + 1 + rank)  # each rank its own data
        losses: list[float] = []
        for step in range(steps):
            tokens = torch.randint(0, VOCAB, (batch_size, SEQ_LEN), generator=data_gen)
            target = torch.roll(tokens, shifts=1, dims=1)  # the previous token (wraps around)
            logits = model(tokens)
            loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(mean.item() / world)
            if rank == 0 and step % 10 == 0:
                print(f"step {step} loss {losses[-1]:.4f}", flush=True)

        shards: list[Any] = [None] * world
        dist.all_gather_object(shards, shard_numel)
        # gather the full weights on rank 0 only (other ranks get an empty dict). The model is
        # already on CPU: offload_to_cpu=True (the usual GPU setting) crashes torch 2.13 here.
        policy = FullStateDictConfig(offload_to_cpu=False, rank0_only=True)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, policy):
            state = model.state_dict()
        # FSDP may still have communication in flight on some rank: finish it everywhere before
        # the process group is torn down (else gloo can abort the process at exit)
        dist.barrier()
        if rank != 0:
            return {}
        num_params = sum(t.numel() for t in state.values())
        print(f"full state dict on rank 0: {len(state)} tensors, {num_params} parameters", flush=True)
        return {
            "num_params": num_params,
            "losses": losses,
            "first_loss": losses[0],
            "final_loss": losses[-1],
            "state_dict_keys": sorted(state),
            "shard_numel": shards,
        }
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """Command line: run :func:`train`; 0 if the loss went down."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-processes", type=int, default=2, help="number of ranks (default 2)")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps (default 40)")
    parser.add_argument("--local-mode", action="store_true", help="run the ranks on this machine")
    args = parser.parse_args(argv)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from spark_torch import Distributor

    result = Distributor(num_processes=args.num_processes, local_mode=args.local_mode).run(train, steps=args.steps)
    print(f"parameters: {result['num_params']} (per-rank shards: {result['shard_numel']})")
    print(f"loss: {result['first_loss']:.4f} -> {result['final_loss']:.4f}")
    return 0 if result["final_loss"] < result["first_loss"] else 1


if __name__ == "__main__":
    sys.exit(main())
