#!/usr/bin/env python
"""What replica groups (torchft) cost per step, and what a lost group costs the others.

    SPARK_LOCAL_IP=127.0.0.1 .venv/bin/python benchmarks/bench_ft.py [--pairs 5] [--steps 300] [--kills 3]

1. Per step: a 2-group run (``replica_groups=2``, groups of one rank, torchft's DDP, the
   commit as its Optimizer makes it) against plain DDP on gloo of the same world size (2 ranks), the same model (an
   MLP of 64x256x1, batch 32) and the same steps, in local mode. Rank 0 times every step once
   every group takes part (after 20 warm-up steps); a run's value is its median step. The two
   runs alternate in ``--pairs`` interleaved pairs (``analysis.alternating_pairs``): the ratio
   ft / DDP is a geometric mean of the pairs' ratios with a 95% interval.
2. A kill: in ``--kills`` 2-group runs, group 1's process SIGKILLs itself between forward and
   backward at its 50th step taken with group 0. Group 0 logs the time of each commit: the
   **time lost** is its longest gap between two commits minus its median gap; the **time back**
   is from the kill to the killed group's first commit after it (a new process, healed from
   group 0). The lighthouse drops a silent group after ``heartbeat_timeout_ms=1000`` (torchft's
   default is 5000), the main part of both.

Writes benchmarks/results/ft.json and prints the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from analysis import alternating_pairs  # noqa: E402

from spark_torch import Distributor  # noqa: E402
from spark_torch.ft.lighthouse import LighthouseOptions  # noqa: E402

WARMUP = 20
OPTIONS = LighthouseOptions(min_replicas=1, join_timeout_ms=500, quorum_tick_ms=20, heartbeat_timeout_ms=1_000)


def _model() -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))


def ft_steps(steps: int, work: str | None = None, kill_at: int | None = None) -> float:
    """Rank side, a replica group: train until ``steps`` steps after the warm-up were committed
    with both groups; returns rank 0's median step (seconds) of those. With ``work``, every
    commit's time is appended to ``work/g{GROUP}.commits``; with ``kill_at``, group 1's first
    process SIGKILLs itself (writing the time to ``work/killed``) at that joint step."""
    import signal
    from datetime import timedelta

    import torch
    from torchft import DistributedDataParallel

    from spark_torch import ft

    group, groups = int(os.environ["REPLICA_GROUP_ID"]), int(os.environ["NUM_REPLICA_GROUPS"])
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    together = torch.zeros((), dtype=torch.int64)

    def load(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        together.copy_(state["together"])

    wait = timedelta(seconds=30)
    mgr = ft.manager(
        state_dict=lambda: {"model": model.state_dict(), "opt": opt.state_dict(), "together": together},
        load_state_dict=load, timeout=wait, quorum_timeout=wait, connect_timeout=wait,
    )  # fmt: skip
    ddp = DistributedDataParallel(mgr, model)
    x, y = torch.randn(32, 64), torch.randn(32, 1)
    log = open(os.path.join(work, f"g{group}.commits"), "a", buffering=1) if work else None
    killed = os.path.join(work, "killed") if work else ""
    times: list[float] = []
    while True:
        start = time.perf_counter()
        mgr.start_quorum()  # what torchft's Optimizer.zero_grad() does
        opt.zero_grad()
        all_in = mgr.num_participants() == groups
        if all_in and int(together) >= WARMUP + steps:
            break
        loss = (ddp(x) - y).pow(2).mean()
        if kill_at is not None and group == 1 and all_in and int(together) == kill_at and not os.path.exists(killed):
            with open(killed, "w") as fh:
                fh.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        loss.backward()
        if mgr.should_commit():  # what torchft's Optimizer.step() does
            opt.step()
            if all_in and int(together) >= WARMUP:
                times.append(time.perf_counter() - start)
            together += int(all_in)
            if log is not None:
                log.write(f"{os.getpid()} {time.time()!r}\n")
    mgr.shutdown(wait=False)
    return statistics.median(times) if times else float("nan")


def ddp_steps(steps: int) -> float:
    """Rank side, plain DDP on gloo: the same model and steps; rank 0's median step (seconds)."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    model = torch.nn.parallel.DistributedDataParallel(_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(32, 64), torch.randn(32, 1)
    times = []
    for step in range(WARMUP + steps):
        start = time.perf_counter()
        opt.zero_grad()
        (model(x) - y).pow(2).mean().backward()
        opt.step()
        if step >= WARMUP:
            times.append(time.perf_counter() - start)
    dist.destroy_process_group()
    return statistics.median(times)


def per_step(pairs: int, steps: int, storage: str) -> dict[str, Any]:
    groups = Distributor(num_processes=2, replica_groups=2, lighthouse_options=OPTIONS, log_ranks=[], storage_path=storage)
    plain = Distributor(num_processes=2, log_ranks=[], storage_path=storage)
    result = alternating_pairs(pairs, lambda: float(groups.run(ft_steps, steps)), lambda: float(plain.run(ddp_steps, steps)))
    return {"ft_ms": [v * 1000 for v in result["a"]], "ddp_ms": [v * 1000 for v in result["b"]],
            **{k: result.get(k) for k in ("ratio", "low", "high", "pairs")}}  # fmt: skip


def one_kill(steps: int, storage: str) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as work:
        Distributor(
            num_processes=2, replica_groups=2, max_restarts=1, lighthouse_options=OPTIONS, log_ranks=[],
            storage_path=storage, timeout=300,
        ).run(ft_steps, steps, work, 50)  # fmt: skip
        with open(os.path.join(work, "killed")) as fh:
            kill = float(fh.read())
        survivor = [float(line.split()[1]) for line in open(os.path.join(work, "g0.commits"))]
        rows = [line.split() for line in open(os.path.join(work, "g1.commits"))]
    gaps = [b - a for a, b in zip(survivor, survivor[1:])]
    back = min(float(t) for pid, t in rows if pid != rows[0][0]) - kill
    return {"lost_s": max(gaps) - statistics.median(gaps), "back_s": back, "median_gap_ms": statistics.median(gaps) * 1000}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--kills", type=int, default=3)
    args = parser.parse_args()
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as storage:
        steps = per_step(args.pairs, args.steps, storage)
        kills = [one_kill(100, storage) for _ in range(args.kills)]
    out = {"per_step": steps, "kills": kills, "load_start": load, "load_end": os.getloadavg()[0], "cpus": os.cpu_count()}
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "ft.json"), "w") as fh:
        json.dump(out, fh, indent=1)
    print(f"per step: ft {statistics.median(steps['ft_ms']):.2f} ms, DDP {statistics.median(steps['ddp_ms']):.2f} ms, "
          f"ratio {steps['ratio']:.2f} ({steps['low']:.2f}-{steps['high']:.2f}, {steps['pairs']} pairs)")  # fmt: skip
    for kill in kills:
        print(f"kill: lost {kill['lost_s']:.2f} s, back after {kill['back_s']:.2f} s (median gap {kill['median_gap_ms']:.1f} ms)")
    print(f"load average {load:.1f} -> {out['load_end']:.1f} on {out['cpus']} CPUs")


if __name__ == "__main__":
    main()
