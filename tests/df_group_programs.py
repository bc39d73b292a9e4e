"""Rank-side program of tests/test_dataframe_groups.py: a DataFrame trained by replica groups, each
committed step's row ids logged, its kill point forced by a step count and a file, never by timing."""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta


def train_rows(
    steps: int,
    work: str,
    kill_group: int | None = None,
    kill_step: int | None = None,
    kill_rank: int = 0,
    batch_size: int = 10,
    shuffle: bool = False,
    timeout: float = 20.0,
) -> int:
    """Train a linear model on the ``id`` column with torchft's DDP across the groups and an
    all-reduce of the gradients within each group (its own gloo process group), one
    ``rank_loader`` batch per step, until ``steps`` steps were committed with every group taking
    part (counted in the state a group heals from, so that all end at one step).

    Each rank appends every step it took to ``work/g{GROUP}r{RANK}.rows`` after ``should_commit()``:
    ``PID STEP PARTICIPATING COMMITTED ID...`` (the Manager's step of the step, whether this group
    took part, whether it committed, the batch's ids); it reports after each commit. The first
    process of ``kill_group``'s rank ``kill_rank`` SIGKILLs itself between forward and backward at
    the step that every group takes together after ``kill_step`` such steps. At the end each rank
    writes ``FINAL_STEP SKIPPED`` (``spark_torch.data.skipped_batches()``) to ``g{GROUP}r{RANK}.final``.
    Returns the final step."""
    import torch
    import torch.distributed as dist
    from torchft import DistributedDataParallel

    import spark_torch
    from spark_torch import ft
    from spark_torch.data import rank_loader, skipped_batches

    group, groups = int(os.environ["REPLICA_GROUP_ID"]), int(os.environ["NUM_REPLICA_GROUPS"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=120))  # within the group
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    together = torch.zeros((), dtype=torch.int64)  # steps committed with every group taking part

    def load(state: dict[str, object]) -> None:
        model.load_state_dict(state["model"])  # type: ignore[arg-type]
        opt.load_state_dict(state["opt"])  # type: ignore[arg-type]
        together.copy_(state["together"])  # type: ignore[arg-type]

    wait = timedelta(seconds=timeout)
    mgr = ft.manager(
        state_dict=lambda: {"model": model.state_dict(), "opt": opt.state_dict(), "together": together},
        load_state_dict=load,
        timeout=wait,
        quorum_timeout=wait,
        connect_timeout=wait,
    )
    ddp = DistributedDataParallel(mgr, model)
    loader = rank_loader(batch_size=batch_size, shuffle=shuffle, seed=3, columns=["id"])
    killed = os.path.join(work, f"killed{group}")
    done = False
    with open(os.path.join(work, f"g{group}r{rank}.rows"), "a", buffering=1) as log:
        while not done:
            for (ids,) in loader:
                mgr.start_quorum()  # what torchft's Optimizer.zero_grad() does
                opt.zero_grad()
                mgr.wait_quorum()
                all_in = mgr.num_participants() == groups
                if all_in and int(together) >= steps:
                    done = True  # every group is here and done: they all see this same quorum
                    break
                if not all_in:  # a group alone steps at most 10 times a second, so that it does not
                    time.sleep(0.1)  # starve its peer's restart of the CPU (what it trains is decided by steps)
                x = ids.to(torch.float32).unsqueeze(1) / 1000.0
                loss = (ddp(x) - 2.0 * x).pow(2).mean()
                kill_here = group == kill_group and rank == kill_rank and all_in and int(together) == kill_step
                if kill_here and not os.path.exists(killed):
                    open(killed, "w").close()
                    os.kill(os.getpid(), signal.SIGKILL)  # mid-step: the peers' all-reduces lose us
                loss.backward()  # torchft's all-reduce across the groups
                for p in model.parameters():  # and a plain one within the group: a rank a batch short would hang here
                    assert p.grad is not None
                    dist.all_reduce(p.grad)
                    p.grad /= world
                step, participating = mgr.current_step(), mgr.is_participating()
                committed = mgr.should_commit()  # what torchft's Optimizer.step() does
                log.write(
                    f"{os.getpid()} {step} {int(participating)} {int(committed)} {' '.join(map(str, ids.tolist()))}\n"
                )
                if committed:
                    opt.step()
                    together += int(all_in)
                    spark_torch.report({"loss": float(loss.detach())})
    final = mgr.current_step()
    with open(os.path.join(work, f"g{group}r{rank}.final"), "w") as fh:
        fh.write(f"{final} {skipped_batches()}")
    mgr.shutdown(wait=False)
    dist.destroy_process_group()
    return int(final)
