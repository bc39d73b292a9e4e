#!/usr/bin/env python
"""What a killed replica group costs the surviving group: its pause, at spark_torch's defaults
against torchft's lighthouse defaults, side by side.

    SPARK_LOCAL_IP=127.0.0.1 .venv/bin/python benchmarks/bench_ft_pause.py [--kills 4] [--modes local,local[2]]

Two groups of one rank (an MLP of 64x256x1, batch 32, torchft's DDP through
``spark_torch.ft.manager()`` with its default timeouts), ``max_restarts=1``. Group 1's first
process SIGKILLs itself between forward and backward at the 30th step both groups took together
(a step count, not a time), writing the time first; each group logs the time of each of its
commits. For each kill:

- **pause**: from the kill to the surviving group's next commit (the survivor's all-reduce of the
  step in flight fails, its next quorum waits until the lighthouse no longer counts the dead
  group as alive, then it takes a step alone);
- **stall**: the survivor's longest gap between two commits around the kill minus its median gap;
- **back**: from the kill to the killed group's first commit in its new process (a restart and a
  heal from group 0).

Each kill runs once with the lighthouse as ``run()`` sets it up by default (``default``) and once
with torchft's own lighthouse defaults (``torchft``: ``LighthouseOptions(heartbeat_timeout_ms=5000,
quorum_tick_ms=100, join_timeout_ms=100)``, what spark_torch used before), alternating, in local
mode and on ``local[2]`` (each group a barrier job). Writes benchmarks/results/ft_pause.json and
prints a table.
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
sys.path.insert(0, os.path.dirname(HERE))

from spark_torch import Distributor  # noqa: E402
from spark_torch.ft.lighthouse import LighthouseOptions  # noqa: E402

KILL_AT = 30
STEPS = 60
#: what spark_torch used before: torchft's lighthouse defaults (its Python binding's)
TORCHFT = LighthouseOptions(min_replicas=1, join_timeout_ms=100, quorum_tick_ms=100, heartbeat_timeout_ms=5_000)


def train(steps: int, work: str, kill_at: int) -> int:
    """Rank side: train until ``steps`` steps were committed by both groups together; log each
    commit's time to ``work/g{GROUP}.commits`` (rank 0 of the group; another rank R to
    ``work/g{GROUP}r{R}.commits``); the first process of group 1's last rank SIGKILLs itself at
    joint step ``kill_at``, after writing the time to ``work/killed``."""
    import signal

    import torch
    from torchft import DistributedDataParallel

    from spark_torch import ft

    group, groups = int(os.environ["REPLICA_GROUP_ID"]), int(os.environ["NUM_REPLICA_GROUPS"])
    rank, last = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]) - 1
    name = f"g{group}" if rank == 0 else f"g{group}r{rank}"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    together = torch.zeros((), dtype=torch.int64)

    def load(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        together.copy_(state["together"])

    mgr = ft.manager(
        state_dict=lambda: {"model": model.state_dict(), "opt": opt.state_dict(), "together": together},
        load_state_dict=load,
    )
    ddp = DistributedDataParallel(mgr, model)
    with open(os.path.join(work, f"{name}.ready"), "a") as fh:
        fh.write(f"{os.getpid()} {time.time()!r}\n")
    x, y = torch.randn(32, 64), torch.randn(32, 1)
    killed = os.path.join(work, "killed")
    with open(os.path.join(work, f"{name}.commits"), "a", buffering=1) as log:
        while True:
            mgr.start_quorum()  # what torchft's Optimizer.zero_grad() does
            opt.zero_grad()
            all_in = mgr.num_participants() == groups
            if all_in and int(together) >= steps:
                break
            loss = (ddp(x) - y).pow(2).mean()
            if group == 1 and rank == last and all_in and int(together) == kill_at and not os.path.exists(killed):
                with open(killed, "w") as fh:
                    fh.write(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            loss.backward()
            if mgr.should_commit():  # what torchft's Optimizer.step() does
                opt.step()
                together += int(all_in)
                log.write(f"{os.getpid()} {time.time()!r} {mgr.num_participants()}\n")
    mgr.shutdown(wait=False)
    return int(together)


def one_kill(options: LighthouseOptions | None, spark: Any, storage: str, ranks: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as work:
        Distributor(
            num_processes=2 * ranks,
            replica_groups=2,
            max_restarts=1,
            lighthouse_options=options,
            log_ranks=[],
            storage_path=storage,
            timeout=300,
            local_mode=spark is None,
            spark=spark,
            warm_start=spark is None,
            ranks_per_task=None if spark is None else ranks,
        ).run(train, STEPS, work, KILL_AT)
        with open(os.path.join(work, "killed")) as fh:
            kill = float(fh.read())
        survivor = [float(line.split()[1]) for line in open(os.path.join(work, "g0.commits"))]
        rows = [line.split() for line in open(os.path.join(work, "g1.commits"))]
        ready = [line.split() for line in open(os.path.join(work, "g1.ready"))]  # rank 0's
        alone = sum(1 for line in open(os.path.join(work, "g0.commits")) if line.split()[2] == "1")
    gaps = [b - a for a, b in zip(survivor, survivor[1:])]
    return {
        "pause_s": min(t for t in survivor if t > kill) - kill,
        "stall_s": max(b - a for a, b in zip(survivor, survivor[1:]) if b > kill and a < kill + 30)
        - statistics.median(gaps),
        "back_s": min(float(t) for pid, t, _ in rows if pid != rows[0][0]) - kill,
        "ready_s": float(ready[-1][1]) - kill,
        "alone": alone,
        "median_gap_ms": statistics.median(gaps) * 1000,
        "load": os.getloadavg()[0],
    }


def _session() -> Any:
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # the executors need torch and torchft too

    spark = (
        SparkSession.builder.master("local[2]")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.ui.enabled", "false")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def _summary(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=4, help="kills per mode and configuration")
    parser.add_argument("--modes", default="local,local[2]")
    parser.add_argument("--ranks", type=int, default=1, help="ranks per group; the killed one is group 1's last")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "ft_pause.json"))
    args = parser.parse_args()
    os.environ.setdefault("RUST_LOG", "error")
    out: dict[str, Any] = {
        "load_start": os.getloadavg()[0],
        "cpus": os.cpu_count(),
        "kill_at": KILL_AT,
        "ranks": args.ranks,
        "runs": {},
    }
    with tempfile.TemporaryDirectory() as storage:
        for mode in args.modes.split(","):
            spark = _session() if mode != "local" else None
            runs: dict[str, list[dict[str, float]]] = {"default": [], "torchft": []}
            for _ in range(args.kills):
                runs["default"].append(one_kill(None, spark, storage, args.ranks))
                runs["torchft"].append(one_kill(TORCHFT, spark, storage, args.ranks))
            out["runs"][mode] = runs
            if spark is not None:
                spark.stop()
            out["load_end"] = os.getloadavg()[0]
            out["time"] = time.strftime("%Y-%m-%d %H:%M:%S")
            os.makedirs(os.path.dirname(args.out), exist_ok=True)
            with open(args.out, "w") as fh:  # after each mode: a run cut short keeps what it measured
                json.dump(out, fh, indent=1)
    print("| mode | lighthouse | pause s, median (range) | stall s | back s | median step ms |")
    print("|---|---|---:|---:|---:|---:|")
    for mode, runs in out["runs"].items():
        for name, kills in runs.items():
            cols = [_summary([k[key] for k in kills]) for key in ("pause_s", "stall_s", "back_s", "median_gap_ms")]
            print(f"| {mode} | {name} | " + " | ".join(cols) + " |")
    print(f"load average {out['load_start']:.1f} -> {out['load_end']:.1f} on {out['cpus']} CPUs")


if __name__ == "__main__":
    main()
