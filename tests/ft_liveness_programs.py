"""Rank-side programs of tests/test_replica_group_liveness.py: two groups, one of them slow
(its process stops after each commit, before its next quorum), each logging what every quorum
it committed in held."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from datetime import timedelta
from typing import Any

#: how long a group may step before every group is in its quorum (the other's ranks starting)
JOIN_SECONDS = 60.0


def slow_group(steps: int, work: str, slow: int, pause: float, heartbeat_interval: float | None = None) -> list[float]:
    """Train a linear model with torchft's DDP until ``steps`` steps were committed with every group
    taking part; group ``slow``'s process is stopped (SIGSTOP, every thread: its Manager's
    heartbeats too, as a process starved of CPU) for ``pause`` seconds after each commit, then
    resumed by a ``sleep; kill -CONT`` of its own (a slow but healthy group: the other waits for
    it in the lighthouse's quorum meanwhile). Each commit is appended to
    ``work/g{GROUP}.quorums`` as ``PID STEP PARTICIPANTS HEALED`` (``HEALED``: 1 when this step
    loaded a peer's state). ``heartbeat_interval`` (seconds): the Manager's, when given. A group
    stops at its first quorum without every group once they stepped together, after 10 rounds
    in a row without a commit, and past :data:`JOIN_SECONDS` without a step with every group: a
    group dropped, or one that can no longer commit, ends the run in seconds, not at the test's
    timeout (it used to step alone up to ``10 * steps`` times its pause). Returns (and writes to
    ``work/g{GROUP}.weights``) the final weights."""
    import torch
    from torchft import DistributedDataParallel

    from spark_torch import ft

    group, groups = int(os.environ["REPLICA_GROUP_ID"]), int(os.environ["NUM_REPLICA_GROUPS"])
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    together = torch.zeros((), dtype=torch.int64)
    healed = []

    def load(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        together.copy_(state["together"])
        healed.append(True)

    wait = timedelta(seconds=60)
    extra: dict[str, Any] = {}
    if heartbeat_interval is not None:
        extra["heartbeat_interval"] = timedelta(seconds=heartbeat_interval)
    mgr = ft.manager(
        state_dict=lambda: {"model": model.state_dict(), "opt": opt.state_dict(), "together": together},
        load_state_dict=load,
        timeout=wait,
        quorum_timeout=wait,
        connect_timeout=wait,
        **extra,
    )
    ddp = DistributedDataParallel(mgr, model)
    with open(os.path.join(work, f"g{group}.quorums"), "a", buffering=1) as log:
        misses, join_by = 0, time.monotonic() + JOIN_SECONDS
        while misses < 10:
            mgr.start_quorum()  # what torchft's Optimizer.zero_grad() does
            opt.zero_grad()
            mgr.wait_quorum()
            all_in = mgr.num_participants() == groups
            if all_in and int(together) >= steps:
                break  # every group is here and done: they all see this same quorum
            if int(together) and not all_in:
                break  # a group was dropped after they had stepped together: the test says so, now
            if not int(together) and time.monotonic() > join_by:
                break  # never stepped with every group: the test says so
            data = torch.Generator().manual_seed(1000 * mgr.current_step() + group)
            x = torch.randn(8, 4, generator=data)
            (ddp(x) - x.sum(dim=1, keepdim=True)).pow(2).mean().backward()
            if mgr.should_commit():
                opt.step()
                together += int(all_in)
                log.write(f"{os.getpid()} {mgr.current_step()} {mgr.num_participants()} {int(bool(healed))}\n")
                healed.clear()
                misses = 0
            else:
                misses += 1
            if group == slow:
                waker = subprocess.Popen(["sh", "-c", f"sleep {pause}; kill -CONT {os.getpid()}"])
                os.kill(os.getpid(), signal.SIGSTOP)
                waker.wait()
    weights = [float(v) for v in torch.cat([p.detach().flatten() for p in model.parameters()])]
    with open(os.path.join(work, f"g{group}.weights"), "w") as fh:
        fh.write(repr(weights))
    mgr.shutdown(wait=False)
    return weights
