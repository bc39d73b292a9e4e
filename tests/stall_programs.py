"""Training functions that stall (shipped to ranks by value): rank 1 waits in a function of its
own while rank 0 waits in all_reduce, the shape of the most common distributed hang."""

from __future__ import annotations

import os
import time


def wait_for_the_loader(seconds: float) -> None:
    """Rank 1's own blocking call (a stand-in for a data loader that never delivers)."""
    time.sleep(seconds)


def one_rank_stuck(seconds: float) -> int:
    """Rank 1 blocks for ``seconds`` before its all_reduce; rank 0 waits in all_reduce. Returns
    the sum of (rank + 1) over the ranks."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://")
    rank = dist.get_rank()
    if rank == 1:
        wait_for_the_loader(seconds)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    dist.destroy_process_group()
    return int(t.item())


def silent_compute(seconds: float) -> int:
    """Every rank computes in Python for ``seconds`` printing nothing, then all_reduces."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://")
    end = time.monotonic() + seconds
    total = 0
    while time.monotonic() < end:
        total += sum(i * i for i in range(2000))
    t = torch.tensor([1.0])
    dist.all_reduce(t)
    dist.destroy_process_group()
    return int(t.item())


def hold_the_gil(seconds: float) -> None:
    """A native call that keeps the GIL (ctypes.PyDLL does not release it): a read of a pipe
    whose writer, a ``sleep``, ends after ``seconds`` (a read goes on after a signal, a sleep
    would not)."""
    import ctypes
    import subprocess

    read_end, write_end = os.pipe()
    writer = subprocess.Popen(["sleep", str(seconds)], stdout=write_end)
    os.close(write_end)
    ctypes.PyDLL(None).read(read_end, ctypes.create_string_buffer(1), 1)
    os.close(read_end)
    writer.wait()


def one_rank_holds_the_gil(seconds: float) -> int:
    """Rank 1 is in a native call holding the GIL for ``seconds``; rank 0 waits in all_reduce."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://")
    rank = dist.get_rank()
    if rank == 1:
        time.sleep(1.0)  # sampled here last: the native call below cannot be sampled
        hold_the_gil(seconds)
    t = torch.tensor([1.0])
    dist.all_reduce(t)
    dist.destroy_process_group()
    return int(t.item())


def stuck_once_after_a_checkpoint(epochs: int) -> dict[str, int]:
    """Reports a checkpoint every epoch; in the first attempt rank 1 blocks in epoch 2 forever
    (the stall detector must stop it); a restart resumes from the latest checkpoint."""
    import tempfile

    import torch
    import torch.distributed as dist

    import spark_torch

    dist.init_process_group("gloo", init_method="env://")
    rank = dist.get_rank()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    start = 0
    checkpoint = spark_torch.get_checkpoint()
    if checkpoint is not None:
        with open(os.path.join(checkpoint, "epoch.txt")) as fh:
            start = int(fh.read())
    for epoch in range(start + 1, epochs + 1):
        if attempt == 0 and epoch == 2 and rank == 1:
            wait_for_the_loader(3600)
        t = torch.ones(1)
        dist.all_reduce(t)
        with tempfile.TemporaryDirectory() as tmp:
            if rank == 0:
                with open(os.path.join(tmp, "epoch.txt"), "w") as fh:
                    fh.write(str(epoch))
            spark_torch.report({"epoch": epoch}, checkpoint=tmp if rank == 0 else None)
    dist.destroy_process_group()
    return {"resumed_from": start, "attempt": attempt}


class BlocksOnRank1:
    """A dataset whose ``__getitem__`` blocks forever in rank 1's DataLoader workers."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> int:
        if self.rank == 1:
            import threading

            threading.Event().wait()  # the data-loader deadlock: this line is the culprit
        return index


def loader_stuck(epochs: int) -> int:
    """A DataLoader (num_workers=2) whose workers hang on rank 1: its main thread only polls them."""
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    dist.init_process_group("gloo", init_method="env://")
    rank = dist.get_rank()
    total = torch.zeros(1)
    for _ in range(epochs):
        for batch in DataLoader(BlocksOnRank1(rank), batch_size=8, num_workers=2):
            total += batch.sum()
            dist.all_reduce(total)
    dist.destroy_process_group()
    return int(total.item())


def waits_in_a_loop(rounds: int) -> int:
    """Rank 1's main loop is ``event.wait(1)`` until an event no one sets; rank 0 all_reduces."""
    import threading

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://")
    rank = dist.get_rank()
    done = threading.Event()
    if rank == 1:
        for _ in range(rounds):
            if done.wait(1):
                break
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.destroy_process_group()
    return int(t.item())


def heartbeat_beside_a_hang(seconds: float) -> int:
    """Rank 1's heartbeat thread prints every 0.2 s while its main thread is blocked."""
    import threading

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://")
    rank = dist.get_rank()
    if rank == 1:
        stop = threading.Event()

        def beat() -> None:
            while not stop.wait(0.2):
                print("heartbeat", flush=True)

        threading.Thread(target=beat, daemon=True).start()
        wait_for_the_loader(seconds)
        stop.set()
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.destroy_process_group()
    return int(t.item())


def native_compute(seconds: float) -> int:
    """Every rank spends about ``seconds`` in one native call that computes (pbkdf2, GIL released)."""
    import hashlib

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://")
    start = time.process_time()
    hashlib.pbkdf2_hmac("sha256", b"password", b"salt", 20_000)
    rate = 20_000 / max(1e-4, time.process_time() - start)  # iterations per CPU second
    begin = time.monotonic()
    hashlib.pbkdf2_hmac("sha256", b"password", b"salt", int(rate * seconds))
    print(f"native call took {time.monotonic() - begin:.1f}s", flush=True)
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.destroy_process_group()
    return int(t.item())


def in_report(seconds: float) -> int:
    """Rank 1 reports step 1 only after ``seconds``: rank 0 waits inside report()."""
    import spark_torch

    if int(os.environ["RANK"]) == 1:
        wait_for_the_loader(seconds)
    spark_torch.report({"loss": 1.0})
    return 1


def one_rank_stops_itself(seconds: float) -> int:
    """Rank 1 sends itself SIGSTOP (a frozen process, state T) before its all_reduce."""
    import signal

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://")
    rank = dist.get_rank()
    if rank == 1:
        time.sleep(seconds)  # sampled here
        os.kill(os.getpid(), signal.SIGSTOP)
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.destroy_process_group()
    return int(t.item())


def fails_once_after_a_checkpoint(epochs: int) -> dict[str, int]:
    """Reports a checkpoint every epoch; the first attempt fails after epoch 1, the restart
    resumes from that checkpoint."""
    import tempfile

    import spark_torch

    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank = int(os.environ["RANK"])
    start = 0
    checkpoint = spark_torch.get_checkpoint()
    if checkpoint is not None:
        with open(os.path.join(checkpoint, "epoch.txt")) as fh:
            start = int(fh.read())
    for epoch in range(start + 1, epochs + 1):
        if attempt == 0 and epoch == 2:
            raise RuntimeError("the first attempt fails after its first checkpoint")
        with tempfile.TemporaryDirectory() as tmp:
            if rank == 0:
                with open(os.path.join(tmp, "epoch.txt"), "w") as fh:
                    fh.write(str(epoch))
            spark_torch.report({"epoch": epoch}, checkpoint=tmp if rank == 0 else None)
    return {"resumed_from": start, "attempt": attempt}


def fetch_in_a_thread(seconds: float) -> None:
    """The thread rank 1's main thread joins: the culprit."""
    wait_for_the_loader(seconds)


def main_joins_a_stuck_thread(seconds: float) -> int:
    """Rank 1's main thread joins a thread that is stuck in ``fetch_in_a_thread``."""
    import threading

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://")
    if dist.get_rank() == 1:
        worker = threading.Thread(target=fetch_in_a_thread, args=(seconds,), name="fetcher", daemon=True)
        worker.start()
        worker.join()
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.destroy_process_group()
    return int(t.item())


def waits_between_collectives(seconds: float) -> int:
    """Healthy loops whose main thread mostly waits (issue 38), each for about ``seconds``: a
    step that sleeps 0.3 s, then one that sleeps 0.05 s, before its all_reduce; a main thread fed
    by a loader thread (``queue.get()``, then all_reduce); a two-stage pipeline whose second
    stage waits in ``recv`` for the first. Returns the number of steps."""
    import queue
    import threading

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://")
    rank = dist.get_rank()
    t = torch.ones(1)
    steps = 0
    for pause in (0.3, 0.05):  # blocking sync on a GPU, a slow step: waiting, then a collective
        for _ in range(int(seconds / pause)):
            time.sleep(pause)
            dist.all_reduce(t)
            steps += 1
    batches: queue.Queue[int] = queue.Queue()
    count = int(seconds / 0.3)

    def load() -> None:  # a prefetch thread that waits on its source (the network, a disk)
        for i in range(count):
            time.sleep(0.3)
            batches.put(i)

    threading.Thread(target=load, name="loader", daemon=True).start()
    for _ in range(count):
        batches.get()
        dist.all_reduce(t)
        steps += 1
    for _ in range(count):  # stage 0 computes (sleeps) and sends, stage 1 waits in recv
        if rank == 0:
            time.sleep(0.3)
            dist.send(t, 1)
        else:
            dist.recv(t, 0)
        steps += 1
    dist.destroy_process_group()
    return steps


def sleeps_holding_the_gil(seconds: int) -> int:
    """Rank 1 sleeps ``seconds`` in libc's ``sleep`` holding the GIL while rank 0 waits in
    all_reduce; returns what ``sleep`` returned (0: it slept the whole time, not interrupted)."""
    import ctypes

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://")
    left = 0
    if dist.get_rank() == 1:
        time.sleep(1.0)  # sampled here last
        left = ctypes.PyDLL(None).sleep(seconds)  # PyDLL: the GIL stays held
    t = torch.tensor([float(left)])
    dist.all_reduce(t)
    dist.destroy_process_group()
    return int(t.item())


def holds_the_gil_from_its_first_step(seconds: int, note: str) -> int:
    """Rank 1 sleeps ``seconds`` in libc's ``sleep`` holding the GIL as its first step (before
    its sampler's first sample); rank 0 waits for it in init_process_group. Rank 1 writes to
    ``note`` when it started the call and its sampler's record number then (0 or None: no sample yet)."""
    import ctypes
    import json

    if os.environ["RANK"] == "1":
        try:
            with open(os.environ["SPARK_TORCH_STACK_FILE"]) as fh:
                seq = json.load(fh)["seq"]
        except FileNotFoundError:
            seq = None  # no record at all yet
        with open(note, "w") as fh:
            json.dump({"time": time.time(), "seq": seq}, fh)
        ctypes.PyDLL(None).sleep(seconds)  # PyDLL: the GIL stays held
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://")
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.destroy_process_group()
    return int(t.item())


def works_elsewhere(seconds: float) -> int:
    """Rank 1 works outside its main thread while rank 0 waits in all_reduce, each shape for about
    ``seconds``: a CPU-busy child (``subprocess.run``), a ``multiprocessing.Pool`` that computes;
    then rank 0's report() upload waits on another thread (as s3fs does over a slow link) while
    rank 1 waits in report(); then rank 1 returns leaving a process that ignores SIGTERM for
    ``2 * seconds`` (its keeper stops it while rank 1 is finished: longer than a stall and the
    driver's wait for the traces)."""
    import hashlib
    import multiprocessing
    import subprocess
    import sys
    import tempfile
    import threading

    import torch
    import torch.distributed as dist

    import spark_torch
    from spark_torch.reporting.storage import RunStorage

    dist.init_process_group("gloo", init_method="env://")
    rank = dist.get_rank()
    t = torch.ones(1)
    if rank == 1:
        spin = f"import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end: pass"
        subprocess.run([sys.executable, "-c", spin], check=True)
    dist.all_reduce(t)
    if rank == 1:
        start = time.process_time()
        hashlib.pbkdf2_hmac("sha256", b"password", b"salt", 20_000)
        rate = 20_000 / max(1e-4, time.process_time() - start)  # iterations per CPU second
        with multiprocessing.get_context("fork").Pool(1) as pool:
            pool.apply(hashlib.pbkdf2_hmac, ("sha256", b"password", b"salt", int(rate * seconds)))
    dist.all_reduce(t)
    upload = RunStorage.upload

    def slow_upload(self: RunStorage, directory: str, step: int) -> None:
        done = threading.Event()  # the main thread waits while another thread waits on the network
        threading.Thread(target=lambda: (time.sleep(seconds), done.set()), daemon=True).start()
        done.wait()
        upload(self, directory, step)

    RunStorage.upload = slow_upload  # type: ignore[method-assign]
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "state.txt"), "w") as fh:
            fh.write("1")
        spark_torch.report({"loss": 1.0}, checkpoint=tmp if rank == 0 else None)
    dist.all_reduce(t)
    dist.destroy_process_group()
    if rank == 1:  # left behind: it ignores SIGTERM, so the keeper waits before its SIGKILL
        subprocess.Popen(["sh", "-c", f"trap '' TERM; sleep {2 * seconds}"])
    return int(t.item())
