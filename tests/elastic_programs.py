"""Training functions for the elastic tests (shipped to ranks by value).

``count_epochs`` adds exactly 1 per epoch whatever the world size (an all-reduce of ones divided
by the world size), checkpoints the count every epoch and reports it: a run that lost or gained
nodes ends with ``count == epochs`` only if every epoch ran exactly once.
"""

from __future__ import annotations

import os
import signal
import tempfile
import time
from typing import Any


def lose_this_machine() -> None:
    """A lost machine: SIGKILL the executor JVM that runs this rank's barrier task, and the rank."""
    import psutil

    for parent in psutil.Process().parents():
        if "CoarseGrainedExecutorBackend" in " ".join(parent.cmdline()):
            parent.kill()
            break
    os.kill(os.getpid(), signal.SIGKILL)


def _wait_for(path: str, seconds: float = 300) -> None:
    deadline = time.monotonic() + seconds
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {seconds:g} s")
        time.sleep(0.1)


def count_epochs(
    epochs: int,
    marker_dir: str | None = None,
    pause: float = 0.0,
    kill_executor_at: int | None = None,
    hold_file: str | None = None,
    hold_at: int = 10,
    lost_file: str | None = None,
) -> dict[str, Any]:
    """Count the epochs with an all-reduce, a checkpoint per epoch. With ``hold_file``, a restarted
    attempt of one rank waits before epoch ``hold_at`` until that file exists (a test's way to keep
    the run going until a lost worker is back, whatever the machine's speed), and never starts
    epoch ``hold_at + 1`` (it is stopped there to grow; a TimeoutError after 300 s otherwise).
    With ``lost_file``, the first attempt waits before epoch 4 until that file exists (the test
    has stopped a worker: the attempt cannot end before it loses a node)."""
    import json

    import torch
    import torch.distributed as dist

    import spark_torch

    dist.init_process_group("gloo", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = os.environ["SPARK_TORCH_RESTART_COUNT"]
    count, start = 0.0, 0
    checkpoint = spark_torch.get_checkpoint()
    if checkpoint is not None:
        state = json.loads((checkpoint / "state.json").read_text())
        count, start = state["count"], state["epoch"]
    for epoch in range(start + 1, epochs + 1):
        if hold_file is not None and world == 1 and attempt != "0":
            if epoch == hold_at:
                _wait_for(hold_file)
            elif epoch == hold_at + 1:
                _wait_for(hold_file + ".never")  # the grow stops this attempt here
        if lost_file is not None and epoch == 4 and attempt == "0":
            _wait_for(lost_file)
        ones = torch.ones(1)
        dist.all_reduce(ones)
        count += ones.item() / world
        time.sleep(pause)
        if kill_executor_at == epoch and rank == world - 1 and attempt == "0":
            lose_this_machine()
        with tempfile.TemporaryDirectory() as tmp:
            if rank == 0:
                with open(os.path.join(tmp, "state.json"), "w") as fh:
                    json.dump({"count": count, "epoch": epoch}, fh)
            spark_torch.report({"epoch": epoch, "count": count}, checkpoint=tmp if rank == 0 else None)
        if marker_dir is not None and rank == 0:
            open(os.path.join(marker_dir, f"attempt-{attempt}-world-{world}-epoch-{epoch}"), "w").close()
    dist.destroy_process_group()
    return {"count": count, "world_size": world}


def rows_per_epoch(epochs: int, kill_executor_at: int | None = None) -> list[list[int]]:
    """run_on_dataframe: every epoch, the ids of the rows all ranks saw (gathered), with a
    checkpoint per epoch; the last rank's executor is killed after ``kill_executor_at``."""
    import json

    import torch.distributed as dist

    import spark_torch
    from spark_torch.data import rank_loader

    dist.init_process_group("gloo", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    seen: list[list[int]] = []
    checkpoint = spark_torch.get_checkpoint()
    if checkpoint is not None:
        seen = json.loads((checkpoint / "seen.json").read_text())
    for epoch in range(len(seen) + 1, epochs + 1):
        mine = [int(i) for batch in rank_loader(batch_size=4) for i in batch["id"]]
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, mine)
        seen.append(sorted(i for part in gathered for i in part))
        if kill_executor_at == epoch and rank == world - 1 and os.environ["SPARK_TORCH_RESTART_COUNT"] == "0":
            lose_this_machine()
        with tempfile.TemporaryDirectory() as tmp:
            if rank == 0:
                with open(os.path.join(tmp, "seen.json"), "w") as fh:
                    json.dump(seen, fh)
            spark_torch.report({"epoch": epoch}, checkpoint=tmp if rank == 0 else None)
    dist.destroy_process_group()
    return seen
