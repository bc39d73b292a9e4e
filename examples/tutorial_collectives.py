"""Every ``torch.distributed`` collective, on gloo, with the value each rank ends up with.

Each rank starts from tensors built from its rank number ``r`` (world size ``N``) and runs:
``broadcast``, ``all_reduce`` (SUM, PRODUCT, MAX, MIN), ``reduce``, ``all_gather``,
``all_gather_into_tensor``, ``gather``, ``scatter``, ``reduce_scatter``,
``reduce_scatter_tensor``, ``all_to_all``, ``all_to_all_single``, ``barrier`` and the
object collectives (``broadcast_object_list``, ``all_gather_object``, ``gather_object``,
``scatter_object_list``). Rank 0 returns what every rank saw, so the driver can print it.

    python examples/tutorial_collectives.py
    python examples/tutorial_collectives.py --num-processes 4 --local-mode
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from typing import Any


def collectives() -> dict[str, Any]:
    """Run every collective; rank 0 returns ``{name: [value on rank 0, value on rank 1, ...]}``."""
    import torch
    import torch.distributed as dist

    # torch 2.13 prefers the *_single spellings of two collectives; the classic names still work
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    dist.init_process_group("gloo", init_method="env://")
    try:
        r, n = dist.get_rank(), dist.get_world_size()
        mine: dict[str, Any] = {}

        t = torch.tensor([42.0]) if r == 0 else torch.zeros(1)
        dist.broadcast(t, src=0)  # everyone gets rank 0's 42
        mine["broadcast"] = t.item()

        for name, op in [
            ("sum", dist.ReduceOp.SUM),
            ("product", dist.ReduceOp.PRODUCT),
            ("max", dist.ReduceOp.MAX),
            ("min", dist.ReduceOp.MIN),
        ]:
            t = torch.tensor([float(r + 1)])
            dist.all_reduce(t, op=op)
            mine[f"all_reduce_{name}"] = t.item()

        t = torch.tensor([float(r + 1)])
        dist.reduce(t, dst=0, op=dist.ReduceOp.SUM)  # only rank 0's tensor is defined afterwards
        mine["reduce"] = t.item() if r == 0 else None

        parts = [torch.zeros(1) for _ in range(n)]
        dist.all_gather(parts, torch.tensor([float(r)]))
        mine["all_gather"] = [p.item() for p in parts]

        out = torch.zeros(n)
        dist.all_gather_into_tensor(out, torch.tensor([float(r)]))
        mine["all_gather_into_tensor"] = out.tolist()

        parts = [torch.zeros(1) for _ in range(n)] if r == 0 else None
        dist.gather(torch.tensor([float(r * 10)]), gather_list=parts, dst=0)
        mine["gather"] = [p.item() for p in parts] if parts is not None else None

        t = torch.zeros(1)
        dist.scatter(t, scatter_list=[torch.tensor([float(i * 100)]) for i in range(n)] if r == 0 else None, src=0)
        mine["scatter"] = t.item()

        t = torch.zeros(1)  # rank r receives the sum over ranks of their r-th input
        dist.reduce_scatter(t, [torch.tensor([float(r + i)]) for i in range(n)])
        mine["reduce_scatter"] = t.item()

        t = torch.zeros(1)
        dist.reduce_scatter_tensor(t, torch.arange(n, dtype=torch.float32) + r)
        mine["reduce_scatter_tensor"] = t.item()

        outs = [torch.zeros(1) for _ in range(n)]  # rank r gets the r-th tensor of every rank
        dist.all_to_all(outs, [torch.tensor([float(r * n + i)]) for i in range(n)])
        mine["all_to_all"] = [o.item() for o in outs]

        out = torch.zeros(n)
        dist.all_to_all_single(out, torch.arange(n, dtype=torch.float32) + r * n)
        mine["all_to_all_single"] = out.tolist()

        dist.barrier()
        mine["barrier"] = True

        objs: list[Any] = [{"from": "rank 0", "lr": 0.1}] if r == 0 else [None]
        dist.broadcast_object_list(objs, src=0)
        mine["broadcast_object_list"] = objs[0]

        everyone: list[Any] = [None] * n
        dist.all_gather_object(everyone, f"hello from {r}")
        mine["all_gather_object"] = everyone

        gathered: list[Any] | None = [None] * n if r == 0 else None
        dist.gather_object({"rank": r}, gathered, dst=0)
        mine["gather_object"] = gathered

        received: list[Any] = [None]
        dist.scatter_object_list(received, [f"item {i}" for i in range(n)] if r == 0 else None, src=0)
        mine["scatter_object_list"] = received[0]

        per_rank: list[Any] = [None] * n
        dist.all_gather_object(per_rank, mine)
        return {name: [per_rank[i][name] for i in range(n)] for name in mine}
    finally:
        dist.destroy_process_group()


def expected(n: int) -> dict[str, Any]:
    """What :func:`collectives` returns for world size ``n`` (the semantics, spelled out)."""
    import math

    ranks = range(n)
    return {
        "broadcast": [42.0] * n,
        "all_reduce_sum": [float(sum(i + 1 for i in ranks))] * n,
        "all_reduce_product": [float(math.prod(i + 1 for i in ranks))] * n,
        "all_reduce_max": [float(n)] * n,
        "all_reduce_min": [1.0] * n,
        "reduce": [float(sum(i + 1 for i in ranks))] + [None] * (n - 1),
        "all_gather": [[float(i) for i in ranks]] * n,
        "all_gather_into_tensor": [[float(i) for i in ranks]] * n,
        "gather": [[float(i * 10) for i in ranks]] + [None] * (n - 1),
        "scatter": [float(i * 100) for i in ranks],
        "reduce_scatter": [float(sum(j + i for j in ranks)) for i in ranks],
        "reduce_scatter_tensor": [float(sum(j + i for j in ranks)) for i in ranks],
        "all_to_all": [[float(j * n + i) for j in ranks] for i in ranks],
        "all_to_all_single": [[float(j * n + i) for j in ranks] for i in ranks],
        "barrier": [True] * n,
        "broadcast_object_list": [{"from": "rank 0", "lr": 0.1}] * n,
        "all_gather_object": [[f"hello from {i}" for i in ranks]] * n,
        "gather_object": [[{"rank": i} for i in ranks]] + [None] * (n - 1),
        "scatter_object_list": [f"item {i}" for i in ranks],
    }


def main(argv: list[str] | None = None) -> int:
    """Command line: run :func:`collectives`, print each result, 0 if all are as expected."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-processes", type=int, default=2, help="number of ranks (default 2)")
    parser.add_argument("--local-mode", action="store_true", help="run the ranks on this machine")
    args = parser.parse_args(argv)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from spark_torch import Distributor

    result = Distributor(num_processes=args.num_processes, local_mode=args.local_mode).run(collectives)
    want = expected(args.num_processes)
    ok = True
    for name, values in result.items():
        mark = "ok" if values == want[name] else f"EXPECTED {want[name]}"
        ok &= values == want[name]
        print(f"{name:24s} {values}  {mark}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
