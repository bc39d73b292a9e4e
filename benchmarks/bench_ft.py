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

3. ``--cnn``: a realistic step instead (and only this): a CNN of 1.0M parameters (3x16x16
   images, batch 32; 14 ms at best a step on one thread here), one thread per rank (2
   ranks on 2 cores), in ``--pairs`` rounds of the ``--kinds`` runs (by default four): plain DDP,
   torchft's DDP as spark_torch wires it (``ft``), optionally torchft's DDP with torchft's own
   per-step path (``ft_torchft``: its hook that waits for each all-reduce, the commit's round trip
   to the group's Manager server), torchft's ``LocalSGD`` and ``DiLoCo`` (weights synced every
   ``--every`` steps; DiLoCo with an outer SGD with Nesterov momentum and the synchronous quorum
   it requires), each of 2 groups of one rank with
   ``min_replicas=2``; the order rotates from round to round. A run's value is rank 0's **mean**
   step over the timed steps (the syncs included: one step in ``--every`` carries one); each
   ratio to DDP is the geometric mean of the rounds' ratios with a 95% interval. The load average
   (``os.getloadavg``) is recorded before and after each run. Writes benchmarks/results/ft_cnn.json.
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


def _cnn() -> tuple[Any, Any, Any]:
    """The realistic step's model (1,010,218 parameters), a batch and its labels."""
    import torch

    torch.manual_seed(0)
    n = torch.nn
    model = n.Sequential(
        n.Conv2d(3, 16, 3, padding=1),
        n.ReLU(),
        n.Conv2d(16, 32, 3, stride=2, padding=1),
        n.ReLU(),
        n.Conv2d(32, 64, 3, stride=2, padding=1),
        n.ReLU(),
        n.Flatten(),
        n.Linear(64 * 4 * 4, 768),
        n.ReLU(),
        n.Linear(768, 256),
        n.ReLU(),
        n.Linear(256, 10),
    )
    return model, torch.randn(32, 3, 16, 16), torch.randint(0, 10, (32,))


def cnn_steps(kind: str, steps: int, every: int) -> dict[str, Any]:
    """Rank side of ``--cnn``: ``WARMUP + steps`` steps of the CNN as ``kind`` ("ddp", "ft",
    "localsgd", "diloco") trains; rank 0's step times (seconds) after the warm-up and its torch
    threads."""
    from datetime import timedelta

    import torch
    import torch.nn.functional as F

    model, x, y = _cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    wrapper: Any = None
    mgr: Any = None
    if kind == "ddp":
        import torch.distributed as dist

        dist.init_process_group("gloo")
        net = torch.nn.parallel.DistributedDataParallel(model)
    else:
        from torchft import DistributedDataParallel
        from torchft.local_sgd import DiLoCo, LocalSGD

        from spark_torch import ft

        wait = timedelta(seconds=60)
        mgr = ft.manager(
            state_dict=lambda: {"model": model.state_dict(), "opt": opt.state_dict()},
            load_state_dict=lambda _: None,
            timeout=wait,
            quorum_timeout=wait,
            connect_timeout=wait,
            use_async_quorum=kind != "diloco",
        )
        if kind == "ft_torchft":
            _torchft_step_path(mgr)
        net = DistributedDataParallel(mgr, model) if kind.startswith("ft") else model
        if kind == "localsgd":
            wrapper = LocalSGD(mgr, model, opt, sync_every=every)
        elif kind == "diloco":
            outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
            wrapper = DiLoCo(mgr, [model], opt, outer, sync_every=every)
    times = []
    if wrapper is not None:
        wrapper.__enter__()
    for step in range(WARMUP + steps):
        start = time.perf_counter()
        if kind.startswith("ft"):
            mgr.start_quorum()  # what torchft's Optimizer.zero_grad() does
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        if not kind.startswith("ft") or mgr.should_commit():  # what torchft's Optimizer.step() does
            opt.step()  # LocalSGD's / DiLoCo's hook syncs at every ``every``-th
        if step >= WARMUP:
            times.append(time.perf_counter() - start)
    if wrapper is not None:
        wrapper.__exit__(None, None, None)
    if mgr is not None:
        mgr.shutdown(wait=False)
    # no destroy_process_group(): once, rank 1's hung (GIL held, 2 min) after rank 0's had returned
    return {"times": times, "threads": torch.get_num_threads()}


def _torchft_step_path(mgr: Any) -> None:
    """``ft_torchft``: torchft's own per-step path in ``mgr``'s rank, as spark_torch had it before
    ``spark_torch.ft.ddp_fix`` made it cheaper: the DDP hook waits for each all-reduce (fixed for a
    lost peer), and ``should_commit`` asks the group's Manager server."""
    import functools

    import torch
    from torch.distributed import GradBucket  # type: ignore[attr-defined]
    from torchft import ddp

    from spark_torch.ft import ddp_fix

    def hook(state: Any, bucket: Any) -> Any:
        return ddp_fix.blocking_hook(state, bucket)

    hook.__annotations__ = {"state": Any, "bucket": GradBucket, "return": torch.futures.Future[torch.Tensor]}
    ddp.DistributedDataParallel._comm_hook = staticmethod(hook)
    mgr.should_commit = functools.partial(type(mgr).should_commit.__wrapped__, mgr)


KINDS = ("ddp", "ft", "localsgd", "diloco")
#: what ``--kinds`` may name: ``KINDS`` and ``ft_torchft`` (torchft's own per-step path, for comparison)
ALL_KINDS = KINDS + ("ft_torchft",)


def cnn_rounds(rounds: int, steps: int, every: int, storage: str, kinds: tuple[str, ...] = KINDS) -> dict[str, Any]:
    """``rounds`` rounds of ``kinds`` (the first is "ddp"), the order rotating; the ratios of each to DDP."""
    from analysis import paired_ratio

    both = LighthouseOptions(min_replicas=2, join_timeout_ms=500, quorum_tick_ms=20, heartbeat_timeout_ms=1_000)
    bounded = {"log_ranks": [], "storage_path": storage, "timeout": 300}  # a hung run fails the benchmark, not waits
    groups = Distributor(num_processes=2, replica_groups=2, lighthouse_options=both, **bounded)
    plain = Distributor(num_processes=2, **bounded)
    runs: dict[str, dict[str, Any]] = {kind: {"values": [], "extra": []} for kind in kinds}
    for round_ in range(rounds):
        for kind in kinds[round_ % len(kinds) :] + kinds[: round_ % len(kinds)]:
            before = os.getloadavg()
            out = (plain if kind == "ddp" else groups).run(cnn_steps, kind, steps, every)
            runs[kind]["values"].append(statistics.mean(out["times"]) * 1000)
            runs[kind]["extra"].append(
                {"pair": round_, "threads": out["threads"], "load": [before[0], os.getloadavg()[0]]}
            )
    result: dict[str, Any] = {"every": every, "steps": steps, "ms": {k: runs[k]["values"] for k in kinds}}
    result["runs"] = {k: runs[k]["extra"] for k in kinds}
    result["ratios"] = {k: paired_ratio(runs[k], runs["ddp"]) for k in kinds[1:]}
    return result


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
        load_state_dict=load,
        timeout=wait,
        quorum_timeout=wait,
        connect_timeout=wait,
    )
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
    groups = Distributor(
        num_processes=2, replica_groups=2, lighthouse_options=OPTIONS, log_ranks=[], storage_path=storage
    )
    plain = Distributor(num_processes=2, log_ranks=[], storage_path=storage)
    result = alternating_pairs(
        pairs, lambda: float(groups.run(ft_steps, steps)), lambda: float(plain.run(ddp_steps, steps))
    )
    return {
        "ft_ms": [v * 1000 for v in result["a"]],
        "ddp_ms": [v * 1000 for v in result["b"]],
        **{k: result.get(k) for k in ("ratio", "low", "high", "pairs")},
    }


def one_kill(steps: int, storage: str) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as work:
        Distributor(
            num_processes=2,
            replica_groups=2,
            max_restarts=1,
            lighthouse_options=OPTIONS,
            log_ranks=[],
            storage_path=storage,
            timeout=300,
        ).run(ft_steps, steps, work, 50)
        with open(os.path.join(work, "killed")) as fh:
            kill = float(fh.read())
        survivor = [float(line.split()[1]) for line in open(os.path.join(work, "g0.commits"))]
        rows = [line.split() for line in open(os.path.join(work, "g1.commits"))]
    gaps = [b - a for a, b in zip(survivor, survivor[1:])]
    back = min(float(t) for pid, t in rows if pid != rows[0][0]) - kill
    return {
        "lost_s": max(gaps) - statistics.median(gaps),
        "back_s": back,
        "median_gap_ms": statistics.median(gaps) * 1000,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--cnn", action="store_true", help="the realistic step, in --pairs rounds (only this)")
    parser.add_argument("--every", type=int, default=20, help="LocalSGD's and DiLoCo's steps between syncs (--cnn)")
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"--cnn's runs, ddp first, of {', '.join(ALL_KINDS)}")
    args = parser.parse_args()
    if args.cnn:
        kinds = tuple(args.kinds.split(","))
        if kinds[0] != "ddp" or not set(kinds) <= set(ALL_KINDS) or len(set(kinds)) != len(kinds):
            parser.error(f"--kinds: ddp first, then some of {', '.join(ALL_KINDS[1:])}, each once")
        return realistic(args.pairs, args.steps, args.every, kinds)
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as storage:
        steps = per_step(args.pairs, args.steps, storage)
        kills = [one_kill(100, storage) for _ in range(args.kills)]
    out = {
        "per_step": steps,
        "kills": kills,
        "load_start": load,
        "load_end": os.getloadavg()[0],
        "cpus": os.cpu_count(),
    }
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "ft.json"), "w") as fh:
        json.dump(out, fh, indent=1)
    print(
        f"per step: ft {statistics.median(steps['ft_ms']):.2f} ms, DDP {statistics.median(steps['ddp_ms']):.2f} ms, "
        f"ratio {steps['ratio']:.2f} ({steps['low']:.2f}-{steps['high']:.2f}, {steps['pairs']} pairs)"
    )
    for kill in kills:
        print(
            f"kill: lost {kill['lost_s']:.2f} s, back after {kill['back_s']:.2f} s (median gap {kill['median_gap_ms']:.1f} ms)"
        )
    print(f"load average {load:.1f} -> {out['load_end']:.1f} on {out['cpus']} CPUs")


def realistic(rounds: int, steps: int, every: int, kinds: tuple[str, ...] = KINDS) -> None:
    load, uptime = os.getloadavg(), open("/proc/uptime").read().split()[0]
    with tempfile.TemporaryDirectory() as storage:
        out = cnn_rounds(rounds, steps, every, storage, kinds)
    out.update(
        {"load_start": list(load), "load_end": list(os.getloadavg()), "cpus": os.cpu_count(), "uptime_s": float(uptime)}
    )
    with open(os.path.join(HERE, "results", "ft_cnn.json"), "w") as fh:
        json.dump(out, fh, indent=1)
    loads = [load for kind in kinds for run in out["runs"][kind] for load in run["load"]]
    for kind in kinds:
        ms = out["ms"][kind]
        line = f"{kind:10} {statistics.median(ms):7.2f} ms a step ({min(ms):.2f}-{max(ms):.2f})"
        ratio = out["ratios"].get(kind)
        if ratio:
            line += f", {ratio['ratio']:.2f}x DDP ({ratio['low']:.2f}-{ratio['high']:.2f}, {ratio['pairs']} rounds)"
        print(line)
    print(
        f"load average {load[0]:.1f} -> {out['load_end'][0]:.1f} on {out['cpus']} CPUs "
        f"(runs' starts and ends: median {statistics.median(loads):.1f}, {min(loads):.1f}-{max(loads):.1f})"
    )


if __name__ == "__main__":
    main()
