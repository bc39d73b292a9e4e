#!/usr/bin/env python
"""Where torchft DDP's per-step time goes in a spark_torch rank (bench_ft.py --cnn's step), by part.

    SPARK_LOCAL_IP=127.0.0.1 .venv/bin/python benchmarks/prof_ft.py [--rounds 3] [--steps 150]

Runs plain DDP and torchft DDP (2 groups of one rank; ``--variants``: "ft" as spark_torch wires
it, "ft_torchft" with torchft's own per-step path: its waiting DDP hook, the commit's round trip)
alternately, each rank one thread, and has rank 0 time each part of each step: forward, backward
(and inside it, the comm hook's time and its wait for the quorum), ``should_commit``, the optimizer
step; for torchft also the quorum's round trip (``start_quorum`` to its future's end). Prints the
median of each part per run (ms), the CPU time a step costs the rank's process and its main
thread, and each thread's CPU time per step (start-up included).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from bench_ft import WARMUP, _cnn, _torchft_step_path  # noqa: E402

from spark_torch import Distributor  # noqa: E402
from spark_torch.ft.lighthouse import LighthouseOptions  # noqa: E402


def prof_steps(kind: str, steps: int, variant: str = "") -> dict[str, Any]:
    """Rank side: bench_ft.py's CNN step as plain DDP (``kind`` "ddp") or torchft's DDP (``variant``
    "ft": as spark_torch wires it; "ft_torchft": torchft's own per-step path); rank 0's median
    time of each part (ms), its CPU time per step (the process's and its main thread's) and each
    of its threads' CPU time per step (by thread name, start-up included)."""
    from collections import defaultdict
    from datetime import timedelta

    import torch
    import torch.nn.functional as F

    model, x, y = _cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    parts: dict[str, list[float]] = defaultdict(list)
    cur: dict[str, float] = defaultdict(float)
    mgr: Any = None
    if kind == "ddp":
        import torch.distributed as dist

        dist.init_process_group("gloo")
        net = torch.nn.parallel.DistributedDataParallel(model)
    else:
        from torchft import DistributedDataParallel
        from torchft import ddp as tddp

        from spark_torch import ft

        wait = timedelta(seconds=60)
        mgr = ft.manager(
            state_dict=lambda: {"model": model.state_dict(), "opt": opt.state_dict()},
            load_state_dict=lambda _: None,
            timeout=wait,
            quorum_timeout=wait,
            connect_timeout=wait,
        )
        if variant == "ft_torchft":  # torchft's own per-step path, as bench_ft.py --kinds ft_torchft has it
            _torchft_step_path(mgr)
        orig_wait_quorum = mgr.wait_quorum

        def wait_quorum() -> None:
            t = time.perf_counter()
            orig_wait_quorum()
            cur["wait_quorum"] += time.perf_counter() - t

        mgr.wait_quorum = wait_quorum
        fixed = tddp.DistributedDataParallel._comm_hook

        def hook(state: Any, bucket: Any) -> Any:
            t = time.perf_counter()
            out = fixed(state, bucket)
            cur["hook"] += time.perf_counter() - t
            cur["buckets"] += 1
            return out

        from torch.distributed import GradBucket  # type: ignore[attr-defined]

        hook.__annotations__ = {"state": Any, "bucket": GradBucket, "return": torch.futures.Future[torch.Tensor]}
        tddp.DistributedDataParallel._comm_hook = staticmethod(hook)
        net = DistributedDataParallel(mgr, model)
    for step in range(WARMUP + steps):
        cur.clear()
        c0, m0 = time.process_time(), time.thread_time()
        t0 = time.perf_counter()
        if mgr is not None:
            mgr.start_quorum()
            qstart = time.perf_counter()
            fut = mgr._quorum_future
            fut.add_done_callback(lambda _f, s=qstart: cur.__setitem__("quorum_rtt", time.perf_counter() - s))
        t1 = time.perf_counter()
        opt.zero_grad()
        out = net(x)
        loss = F.cross_entropy(out, y)
        t2 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        ok = mgr.should_commit() if mgr is not None else True
        t4 = time.perf_counter()
        if ok:
            opt.step()
        t5 = time.perf_counter()
        if step >= WARMUP:
            parts["start_quorum"].append(t1 - t0)
            parts["forward"].append(t2 - t1)
            parts["backward"].append(t3 - t2)
            parts["should_commit"].append(t4 - t3)
            parts["opt_step"].append(t5 - t4)
            parts["total"].append(t5 - t0)
            parts["cpu_process"].append(time.process_time() - c0)
            parts["cpu_main"].append(time.thread_time() - m0)
            for k, v in cur.items():
                parts[k].append(v)
    tick = os.sysconf("SC_CLK_TCK")
    by_name: dict[str, float] = defaultdict(float)
    for tid in os.listdir("/proc/self/task"):
        try:
            name = open(f"/proc/self/task/{tid}/comm").read().strip()
            fields = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        by_name[name] += (int(fields[11]) + int(fields[12])) / tick * 1000 / (WARMUP + steps)
    if mgr is not None:
        mgr.shutdown(wait=False)
    return {
        "thread_cpu_ms": dict(by_name),
        "median_ms": {k: statistics.median(v) * 1000 for k, v in parts.items() if k != "buckets"},
        "mean_ms": {k: statistics.mean(v) * 1000 for k, v in parts.items() if k != "buckets"},
        "buckets": statistics.median(parts["buckets"]) if parts.get("buckets") else None,
        "threads": torch.get_num_threads(),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--variants", default="ft,ft_torchft")
    args = parser.parse_args()
    both = LighthouseOptions(min_replicas=2, join_timeout_ms=500, quorum_tick_ms=20, heartbeat_timeout_ms=1_000)
    with tempfile.TemporaryDirectory() as storage:
        bounded = {"log_ranks": [], "storage_path": storage, "timeout": 300}
        groups = Distributor(num_processes=2, replica_groups=2, lighthouse_options=both, **bounded)
        plain = Distributor(num_processes=2, **bounded)
        for r in range(args.rounds):
            for kind in ["ddp"] + args.variants.split(","):
                load = os.getloadavg()[0]
                if kind == "ddp":
                    out = plain.run(prof_steps, "ddp", args.steps)
                else:
                    out = groups.run(prof_steps, "ft", args.steps, kind)
                med = " ".join(f"{k}={v:.2f}" for k, v in out["median_ms"].items())
                mean = out["mean_ms"]["total"]
                print("   threads cpu ms/step:", {k: round(v, 2) for k, v in out["thread_cpu_ms"].items()})
                print(
                    f"round {r} {kind:10} load {load:.1f} thr {out['threads']} mean {mean:.2f} | median {med}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
