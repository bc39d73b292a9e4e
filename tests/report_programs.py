"""Training functions for the report/checkpoint/resume tests (shipped to ranks by value).

``deterministic_ddp`` trains a tiny DDP model on CPU where every step's data depends only on
(step, rank): a run resumed from a checkpoint ends with exactly the weights of an
uninterrupted run, which is how the chaos tests prove nothing was lost or repeated.
"""

from __future__ import annotations

import os
import signal
import tempfile
from typing import Any


def deterministic_ddp(
    steps: int, ckpt_every: int = 2, die_at: int | None = None, die_rank: int = 1, sharded: bool = False
) -> Any:
    import torch
    import torch.distributed as dist

    import spark_torch

    dist.init_process_group("gloo", init_method="env://")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    start = 0
    resumed_from = None
    checkpoint = spark_torch.get_checkpoint()
    if checkpoint is not None:
        state = torch.load(checkpoint / "state.pt")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = resumed_from = state["step"]
        if sharded:
            assert (checkpoint / f"shard-{rank}.pt").exists(), sorted(os.listdir(checkpoint))
    for step in range(start + 1, steps + 1):
        g = torch.Generator().manual_seed(step * 10 + rank)
        x = torch.randn(8, 4, generator=g)
        loss = ((ddp(x) - x.sum(1, keepdim=True)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if die_at == step and rank == die_rank and os.environ["SPARK_TORCH_RESTART_COUNT"] == "0":
            os.kill(os.getpid(), signal.SIGKILL)  # mid-step: this step was never reported
        save = step % ckpt_every == 0
        with tempfile.TemporaryDirectory() as tmp:
            if save and rank == 0:
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, f"{tmp}/state.pt")
            if save and sharded:
                torch.save({"rank": rank}, f"{tmp}/shard-{rank}.pt")
            passes = save and (rank == 0 or sharded)
            spark_torch.report({"loss": loss.detach(), "rank0_step": step}, checkpoint=tmp if passes else None)
    dist.destroy_process_group()
    return {"weights": [p.detach().clone() for p in model.parameters()], "resumed_from": resumed_from}


def report_bad_metric(kind: str = "list") -> None:
    import spark_torch

    bad: dict[str, Any] = {
        "list": {"weights": [1.0, 2.0]},
        "surrogate": {"name": "caf\udce9"},  # bytes decoded with surrogateescape
        "huge": {"notes": "x" * 100_000},
    }
    spark_torch.report(bad[kind])


def report_after_hiding_storage(storage_dir: str) -> None:
    """Remove the run's marker as if this host saw other storage, then report a checkpoint."""
    import glob

    import spark_torch

    for marker in glob.glob(os.path.join(storage_dir, "*", ".spark_torch_run")):
        os.remove(marker)
    with tempfile.TemporaryDirectory() as tmp:
        spark_torch.report({"x": 1}, checkpoint=tmp)


def report_steps(count: int) -> int:
    import spark_torch

    for i in range(count):
        spark_torch.report({"i": i})
    return count


def kill_my_executor_at(step_to_die: int, steps: int) -> Any:
    """deterministic_ddp, but at ``step_to_die`` (first attempt only) rank 1 SIGKILLs the
    executor JVM that runs its barrier task, and itself: a lost machine takes both at once."""
    import psutil

    import spark_torch

    original = spark_torch.report
    count = {"n": 0}

    def report_then_maybe_kill(metrics: Any, *, checkpoint: Any = None) -> None:
        original(metrics, checkpoint=checkpoint)
        count["n"] += 1
        if count["n"] == step_to_die and os.environ["RANK"] == "1" and os.environ["SPARK_TORCH_RESTART_COUNT"] == "0":
            for parent in psutil.Process().parents():
                if "CoarseGrainedExecutorBackend" in " ".join(parent.cmdline()):
                    parent.kill()
                    break
            os.kill(os.getpid(), signal.SIGKILL)

    spark_torch.report = report_then_maybe_kill  # type: ignore[assignment]
    try:
        return deterministic_ddp(steps, 2)
    finally:
        spark_torch.report = original  # type: ignore[assignment]


def report_and_check_persisted(storage_dir: str, steps: int) -> list[int]:
    """Every rank reports a checkpoint per step and, once report() returned, checks that the
    step's manifest is on storage (report() returns only after its step is durable)."""
    import glob

    import spark_torch

    seen = []
    for step in range(1, steps + 1):
        with tempfile.TemporaryDirectory() as tmp:
            with open(os.path.join(tmp, f"rank-{os.environ['RANK']}.txt"), "w") as fh:
                fh.write(str(step))
            spark_torch.report({"step_seen": step}, checkpoint=tmp)
        manifests = glob.glob(os.path.join(storage_dir, "*", f"checkpoint_{step:06d}", ".spark_torch"))
        if not manifests:
            raise AssertionError(f"report() of step {step} returned before its manifest existed")
        seen.append(step)
    return seen


def report_scores(scores: list[float]) -> int:
    """Rank 0 writes a checkpoint per step, reporting ``score`` = the given values in turn."""
    import spark_torch

    for score in scores:
        with tempfile.TemporaryDirectory() as tmp:
            with open(os.path.join(tmp, "score.txt"), "w") as fh:
                fh.write(str(score))
            spark_torch.report({"score": score}, checkpoint=tmp if os.environ["RANK"] == "0" else None)
    return len(scores)


def fail_first_attempts(failures: int) -> int:
    """Fails in attempts 0 .. failures-1, then returns the attempt number."""
    attempt = int(os.environ["SPARK_TORCH_RESTART_COUNT"])
    if attempt < failures:
        raise RuntimeError(f"attempt {attempt} fails")
    return attempt


def report_on_rank_0_only(steps_together: int, state_dir: str, rank_1_gone_first: bool) -> int:
    """Every rank reports ``steps_together`` steps; then rank 0 reports once more and rank 1
    returns (its process ends). ``rank_1_gone_first``: rank 0 reports only once rank 1's process
    is gone (else rank 0 reports first and rank 1 ends once rank 0 is about to)."""
    import time

    import spark_torch

    rank = int(os.environ["RANK"])
    for _ in range(steps_together):
        spark_torch.report({"rank0": rank})
    pid_file, reporting = os.path.join(state_dir, "rank1.pid"), os.path.join(state_dir, "rank0.reporting")
    if rank == 1:
        if not rank_1_gone_first:
            deadline = time.monotonic() + 120
            while not os.path.exists(reporting):
                assert time.monotonic() < deadline, "rank 0 never got to its report()"
                time.sleep(0.01)
        with open(pid_file + ".tmp", "w") as fh:
            fh.write(str(os.getpid()))
        os.rename(pid_file + ".tmp", pid_file)
        return 1
    if rank_1_gone_first:
        deadline = time.monotonic() + 120
        while not os.path.exists(pid_file) or _alive(int(open(pid_file).read())):
            assert time.monotonic() < deadline, "rank 1's process did not end"
            time.sleep(0.01)
    open(reporting, "w").close()
    spark_torch.report({"alone": 1})
    return 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not open(f"/proc/{pid}/stat").read().split(")")[-1].split()[0] == "Z"  # a zombie has ended


def report_then_fail_on_rank_1() -> None:
    """Both ranks report step 1; rank 1 then raises while rank 0 reports step 2."""
    import spark_torch

    spark_torch.report({"a": 1})
    if os.environ["RANK"] == "1":
        raise ValueError("the real problem of rank 1")
    spark_torch.report({"a": 2})


def report_on_rank_0_in_a_ddp_loop(steps: int) -> int:
    """The usual misuse: report() under ``if rank == 0:`` in a loop whose every step all-reduces.
    Rank 0 waits in report() for rank 1, which waits in the next all_reduce for rank 0."""
    import torch
    import torch.distributed as dist

    import spark_torch

    dist.init_process_group("gloo")
    value = torch.ones(1)
    for step in range(steps):
        dist.all_reduce(value)
        if dist.get_rank() == 0:
            spark_torch.report({"loss": float(step)})
    return int(value.item())
