"""Rank-side programs of tests/test_replica_groups.py: a tiny torchft DDP loop whose kill and
stop points are forced by step numbers and files, never by timing."""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta
from typing import Any


def train(
    steps: int,
    work: str,
    kill_group: int | None = None,
    kill_step: int | None = None,
    timeout: float = 20.0,
    checkpoint: bool = False,
    kill_rank: int = 0,
    stale_group: int | None = None,
    lose_executor: bool = False,
) -> list[float]:
    """Train a linear model with torchft's DDP until ``steps`` steps were committed with every
    group taking part (counted in the state that heals a group: a group alone goes on until the
    others are back, so that all end at one step).

    Each committed step is appended to ``work/g{GROUP}.steps`` as ``PID STEP`` and reported
    (``spark_torch.report``, with a checkpoint of the model, the optimizer, that count and the
    Manager's state when ``checkpoint``). A process that starts from a checkpoint restores all of
    it and writes ``PID STEP`` (the Manager's step after the restore) to ``work/g{GROUP}.resumed``.
    The first process of ``stale_group`` writes its first checkpoint only (its newest is then older
    than its peers').
    The first process of ``kill_group``'s rank ``kill_rank`` (-1: of every group) SIGKILLs itself
    at the step that all groups take together after ``kill_step`` such steps, between forward and
    backward: its peers are then in (or about to enter) the all-reduce; with ``lose_executor`` it
    SIGKILLs the executor JVM that runs its task first (a lost machine). Returns (and writes to
    ``work/g{GROUP}.weights``) the final weights. In groups of several ranks, each rank's files
    are ``g{GROUP}r{RANK}.*`` (each rank is a replica of the same rank of the other groups); each
    rank's ``.env`` holds ``(RANK, NODE_RANK, WORLD_SIZE)``. ``timeout`` bounds each of torchft's waits
    (its default is 60 s)."""
    import tempfile

    import psutil
    import torch
    from torchft import DistributedDataParallel

    import spark_torch
    from spark_torch import ft

    group, groups = int(os.environ["REPLICA_GROUP_ID"]), int(os.environ["NUM_REPLICA_GROUPS"])
    rank = int(os.environ["RANK"])
    name = f"g{group}r{rank}" if int(os.environ["WORLD_SIZE"]) > 1 else f"g{group}"
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    together = torch.zeros((), dtype=torch.int64)  # steps committed with every group taking part

    def load(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        together.copy_(state["together"])

    with open(os.path.join(work, f"{name}.restarts"), "a") as fh:  # each process: its restart count
        fh.write(f"{os.getpid()} {os.environ['TORCHELASTIC_RESTART_COUNT']}\n")
    mgr = ft.manager(
        state_dict=lambda: {"model": model.state_dict(), "opt": opt.state_dict(), "together": together},
        load_state_dict=load,
        timeout=timedelta(seconds=timeout),
        quorum_timeout=timedelta(seconds=timeout),
        connect_timeout=timedelta(seconds=timeout),
    )
    resumed = spark_torch.get_checkpoint()
    if resumed is not None:
        state = torch.load(resumed / "state.pt")
        load(state)
        mgr.load_state_dict(state["manager"])  # torchft's step and committed batches
        with open(os.path.join(work, f"{name}.resumed"), "a") as fh:
            fh.write(f"{os.getpid()} {mgr.current_step()}\n")
    ddp = DistributedDataParallel(mgr, model)
    killed = os.path.join(work, f"killed{group}")
    checkpoints_left = 1 if group == stale_group and resumed is None else None  # None: one at every step
    with open(os.path.join(work, f"{name}.steps"), "a", buffering=1) as log:
        while True:
            mgr.start_quorum()  # what torchft's Optimizer.zero_grad() does
            opt.zero_grad()
            mgr.wait_quorum()
            all_in = mgr.num_participants() == groups
            if all_in and int(together) >= steps:
                break  # every group is here and done: they all see this same quorum
            if not all_in:  # a group alone steps at most 10 times a second, so that it does not
                time.sleep(0.1)  # starve its peers' restart of the CPU (what it trains is decided by steps)
            data = torch.Generator().manual_seed(1000 * mgr.current_step() + group)
            x = torch.randn(8, 4, generator=data)
            loss = (ddp(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
            kill_here = kill_group in (group, -1) and rank == kill_rank
            if kill_here and all_in and int(together) == kill_step and not os.path.exists(killed):
                open(killed, "w").close()
                if lose_executor:  # the executor JVM that runs this rank's task dies, and the rank
                    from tests.elastic_programs import lose_this_machine

                    lose_this_machine()
                os.kill(os.getpid(), signal.SIGKILL)  # mid-step: the peer's all-reduce loses us
            loss.backward()
            if mgr.should_commit():  # what torchft's Optimizer.step() does, and we log the commit
                opt.step()
                together += int(all_in)
                log.write(f"{os.getpid()} {mgr.current_step()}\n")
                keep = checkpoint and checkpoints_left != 0
                if keep and checkpoints_left is not None:
                    checkpoints_left -= 1
                with tempfile.TemporaryDirectory() as folder:
                    if keep and rank == 0:
                        state = {"model": model.state_dict(), "opt": opt.state_dict(), "together": together}
                        torch.save({**state, "manager": mgr.state_dict()}, os.path.join(folder, "state.pt"))
                    spark_torch.report({"loss": float(loss)}, checkpoint=folder if keep else None)
    weights = [float(v) for v in torch.cat([p.detach().flatten() for p in model.parameters()])]
    with open(os.path.join(work, f"{name}.weights"), "w") as fh:
        fh.write(repr(weights))
    with open(os.path.join(work, f"{name}.env"), "w") as fh:  # where the rank ran in its group
        fh.write(repr((rank, int(os.environ["NODE_RANK"]), int(os.environ["WORLD_SIZE"]))))
    with open(os.path.join(work, f"{name}.listening"), "w") as fh:  # this rank's listeners, torchft's included
        fh.write(repr(sorted({c.laddr.ip for c in psutil.Process().net_connections("inet") if c.status == "LISTEN"})))
    mgr.shutdown(wait=False)
    return weights


def local_sgd(syncs: int, every: int, work: str, kill_sync: int | None = None, diloco: bool = False) -> list[float]:
    """Train a linear model with torchft's ``LocalSGD`` (``DiLoCo`` with ``diloco``, an outer SGD
    with Nesterov momentum): each group takes ``every`` local steps, then the groups average their
    weights in one quorum and all-reduce (the hook on the ``every``-th ``opt.step()``). Ends after
    ``syncs`` syncs with every group taking part (counted in the state that heals a group).

    Each sync is appended to ``work/g{GROUP}.syncs`` as ``PID STEP PARTICIPANTS``. The first process
    of group 1 SIGKILLs itself in the middle of the inner loop (before its ``every // 2``-th local
    step) that follows ``kill_sync`` syncs of every group. Returns (and writes to
    ``work/g{GROUP}.weights``) the final weights."""
    import torch
    from torchft.local_sgd import DiLoCo, LocalSGD

    from spark_torch import ft

    group, groups = int(os.environ["REPLICA_GROUP_ID"]), int(os.environ["NUM_REPLICA_GROUPS"])
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    together = torch.zeros((), dtype=torch.int64)  # syncs with every group taking part

    def load(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        together.copy_(state["together"])

    wait = timedelta(seconds=20)
    mgr = ft.manager(
        state_dict=lambda: {"model": model.state_dict(), "opt": opt.state_dict(), "together": together},
        load_state_dict=load,
        timeout=wait,
        quorum_timeout=wait,
        connect_timeout=wait,
        use_async_quorum=not diloco,  # torchft's DiLoCo requires the synchronous quorum
    )
    if diloco:  # DiLoCo adds its outer optimizer's state and the global weights to what heals a group
        outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        wrapper: Any = DiLoCo(mgr, [model], opt, outer, sync_every=every)
    else:
        wrapper = LocalSGD(mgr, model, opt, sync_every=every)
    killed = os.path.join(work, f"killed{group}")
    with wrapper, open(os.path.join(work, f"g{group}.syncs"), "a", buffering=1) as log:
        while True:
            for local in range(every):
                data = torch.Generator().manual_seed(1000 * mgr.current_step() + 10 * local + group)
                x = torch.randn(8, 4, generator=data)
                opt.zero_grad()
                (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean().backward()
                if group == 1 and int(together) == kill_sync and local == every // 2 and not os.path.exists(killed):
                    open(killed, "w").close()
                    os.kill(os.getpid(), signal.SIGKILL)  # mid inner loop: the peer notices at its next sync
                opt.step()  # the every-th one syncs: a quorum, the weights averaged, a commit
            all_in = mgr.num_participants() == groups
            together += int(all_in)
            log.write(f"{os.getpid()} {mgr.current_step()} {mgr.num_participants()}\n")
            if all_in and int(together) >= syncs:
                break  # every group took part in this same sync: they all stop here
    weights = [float(v) for v in torch.cat([p.detach().flatten() for p in model.parameters()])]
    with open(os.path.join(work, f"g{group}.weights"), "w") as fh:
        fh.write(repr(weights))
    mgr.shutdown(wait=False)
    return weights


def diloco_with_the_async_quorum() -> None:
    """Wrap a model in torchft's DiLoCo with the Manager's default quorum (torchft's asynchronous one)."""
    import torch
    from torchft.local_sgd import DiLoCo

    from spark_torch import ft

    model = torch.nn.Linear(2, 1)
    wait = timedelta(seconds=20)
    mgr = ft.manager(
        state_dict=model.state_dict, load_state_dict=model.load_state_dict, timeout=wait, connect_timeout=wait
    )
    try:
        DiLoCo(
            mgr,
            [model],
            torch.optim.SGD(model.parameters(), lr=0.1),
            torch.optim.SGD(model.parameters(), lr=0.7),
            sync_every=2,
        )
    finally:
        mgr.shutdown(wait=False)


def fail_in_group(group_that_fails: int, work: str, steps: int) -> list[float]:
    """``group_that_fails``'s rank 0 raises (every attempt) once group 0 has committed 3 steps on
    each of its ranks (a file, waited for with a deadline); the others train with torchft (alone) until
    the run stops them (the lighthouse goes away: their next quorum fails within 3 s)."""

    group = int(os.environ["REPLICA_GROUP_ID"])
    if group == group_that_fails:
        logs = [os.path.join(work, f"g0r{rank}.steps") for rank in range(int(os.environ["WORLD_SIZE"]))]
        ranks, deadline = len(logs), time.monotonic() + 120
        while not all(os.path.exists(log) and len(open(log).read().splitlines()) >= 3 for log in logs):
            if time.monotonic() > deadline:
                raise TimeoutError(f"group 0 did not commit 3 steps on each of its {ranks} ranks within 120 s")
            time.sleep(0.05)
        if os.environ["RANK"] != "0":
            hang()  # stopped when its group's rank 0 fails: the group's one failure is rank 0's
        raise RuntimeError(f"group {group} cannot start")
    return train(steps, work, timeout=3.0)


def train_while_group_1_hangs(work: str, steps: int) -> list[float]:
    """Group 1's rank hangs outside torchft (never in a quorum); the others train, with torchft's
    waits bounded by 3 s (their quorum times out when it needs group 1)."""
    if os.environ["REPLICA_GROUP_ID"] == "1":
        hang(work)
    return train(steps, work, timeout=3.0)


def fail_while_the_other_hangs(work: str) -> None:
    """Group 0's rank hangs outside torchft (it never makes a Manager: the lighthouse going away
    cannot reach it); group 1's rank raises once group 0's has started (a file, with a deadline)."""

    if os.environ["REPLICA_GROUP_ID"] == "0":
        hang(work)
    started, deadline = os.path.join(work, "started-0"), time.monotonic() + 120
    while not os.path.exists(started):
        if time.monotonic() > deadline:
            raise TimeoutError("group 0's rank did not start within 120 s")
        time.sleep(0.05)
    raise RuntimeError("group 1 cannot start")


def hello_from(source: str, url: str) -> str:
    """What the lighthouse at ``url`` did with an HTTP/2 client's first bytes sent from the address
    ``source``: "answered", "closed" (the connection closed before a byte came back) or "silent"."""
    import socket
    from urllib.parse import urlparse

    where = urlparse(url)
    with socket.socket() as client:
        client.bind((source, 0))
        client.settimeout(5)
        client.connect((where.hostname, where.port))
        client.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")
        try:
            return "answered" if client.recv(100) else "closed"
        except ConnectionResetError:
            return "closed"
        except TimeoutError:
            return "silent"


def listeners_after_a_step() -> tuple[str, list[str], dict[str, str]]:
    """One torchft step (a quorum, an all-reduce, a commit), then the lighthouse this rank was
    given, the addresses its own process listens on (the group's store when the rank hosts it,
    torchft's Manager server, gloo's), and what the lighthouse did with a hello from this rank's
    address (127.0.0.1) and from another address of the machine (127.0.0.2)."""
    import psutil
    import torch

    from spark_torch import ft

    model = torch.nn.Linear(2, 1)
    wait = timedelta(seconds=20)
    mgr = ft.manager(
        state_dict=model.state_dict,
        load_state_dict=model.load_state_dict,
        timeout=wait,
        quorum_timeout=wait,
        connect_timeout=wait,
    )
    mgr.start_quorum()
    mgr.wait_quorum()
    mgr.allreduce(torch.ones(1)).wait()
    mgr.should_commit()
    listening = sorted({c.laddr.ip for c in psutil.Process().net_connections("inet") if c.status == "LISTEN"})
    mgr.shutdown(wait=False)
    lighthouse = os.environ["TORCHFT_LIGHTHOUSE"]
    return lighthouse, listening, {source: hello_from(source, lighthouse) for source in ("127.0.0.1", "127.0.0.2")}


def hang(work: str | None = None) -> None:
    """Write this rank's pid to ``work/started-{GROUP}`` (when given), then never end (until stopped)."""

    if work is not None:
        path = os.path.join(work, f"started-{os.environ['REPLICA_GROUP_ID']}")
        with open(path + ".tmp", "w") as fh:
            fh.write(str(os.getpid()))
        os.replace(path + ".tmp", path)

    while True:
        time.sleep(60)


def what_a_rank_sees(work: str) -> int:
    """A plain function (no torchft Manager): write what this rank sees to ``work/seen-{GROUP}.json``
    (its thread variables and torch's thread count, RUST_LOG, its process title as psutil reads
    it), return the group."""
    import json

    import psutil
    import torch

    group = os.environ["REPLICA_GROUP_ID"]
    seen = {
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "MKL_NUM_THREADS": os.environ.get("MKL_NUM_THREADS"),
        "torch_threads": torch.get_num_threads(),
        "RUST_LOG": os.environ.get("RUST_LOG"),
        "cmdline": psutil.Process().cmdline(),
    }
    path = os.path.join(work, f"seen-{group}.json")
    with open(path + ".tmp", "w") as fh:
        json.dump(seen, fh)
    os.replace(path + ".tmp", path)
    return int(group)


def needs(module: str) -> None:
    """Import ``module`` (as a torchft program imports torchft), then return."""
    import importlib

    importlib.import_module(module)


def torchft_example(steps: int, work: str, kill_group: int, kill_step: int) -> list[float]:
    """torchft's own example (train_ddp.py's shape), unchanged but for the kill and the files: the
    script builds its own ``torchft.Manager`` from torchrun's variables and its own
    ``ProcessGroupGloo``, wraps the model and the optimizer with torchft's, and loops on
    ``manager.current_step()``. The first process of ``kill_group`` SIGKILLs itself after
    ``kill_step`` steps that every group took together, between forward and backward. Each committed step
    is appended to ``work/g{GROUP}.steps`` as ``PID STEP``; the run stops once ``steps`` steps were
    committed with every group taking part (a count in the state, as in :func:`train`); each
    process writes its weights to ``work/g{GROUP}.weights`` and the addresses it listens on to
    ``work/g{GROUP}.listening``, and returns the weights."""
    from datetime import timedelta

    import torch
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

    REPLICA_GROUP_ID = int(os.environ.get("REPLICA_GROUP_ID", 0))  # noqa: N806 - torchft's example's names
    NUM_REPLICA_GROUPS = int(os.environ.get("NUM_REPLICA_GROUPS", 2))  # noqa: N806

    torch.manual_seed(0)
    m = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(m.parameters(), lr=0.05)
    together = torch.zeros((), dtype=torch.int64)  # steps committed with every group in (heals with the model)

    def load_state_dict(state_dict: dict[str, Any]) -> None:
        m.load_state_dict(state_dict["model"])
        optimizer.load_state_dict(state_dict["optim"])
        together.copy_(state_dict["together"])

    def state_dict() -> dict[str, Any]:
        return {"model": m.state_dict(), "optim": optimizer.state_dict(), "together": together}

    pg = ProcessGroupGloo(timeout=timedelta(seconds=20))
    manager = Manager(
        pg=pg,
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"train_ddp_{REPLICA_GROUP_ID}",
        timeout=timedelta(seconds=20),
        quorum_timeout=timedelta(seconds=20),
    )
    model = DistributedDataParallel(manager, m)
    optim = Optimizer(manager, optimizer)
    killed = os.path.join(work, f"killed{REPLICA_GROUP_ID}")
    with open(os.path.join(work, f"g{REPLICA_GROUP_ID}.steps"), "a", buffering=1) as log:
        while True:
            optim.zero_grad()  # starts the quorum
            manager.wait_quorum()
            all_in = manager.num_participants() == NUM_REPLICA_GROUPS
            if all_in and int(together) >= steps:
                break  # every group is here and done: they all see this same quorum
            x = torch.randn(
                8, 4, generator=torch.Generator().manual_seed(1000 * manager.current_step() + REPLICA_GROUP_ID)
            )
            loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
            if REPLICA_GROUP_ID == kill_group and all_in and int(together) == kill_step and not os.path.exists(killed):
                open(killed, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)  # mid-step: the peer's all-reduce loses us
            loss.backward()
            before = manager.current_step()
            optim.step()  # applied only if the step commits everywhere
            if manager.current_step() > before:
                together += int(all_in)
                log.write(f"{os.getpid()} {manager.current_step()}\n")
    weights = [float(v) for v in torch.cat([p.detach().flatten() for p in m.parameters()])]
    with open(os.path.join(work, f"g{REPLICA_GROUP_ID}.weights"), "w") as fh:
        fh.write(repr(weights))
    import psutil

    with open(
        os.path.join(work, f"g{REPLICA_GROUP_ID}.listening"), "w"
    ) as fh:  # the Manager's server and its heal transport's
        fh.write(repr(sorted({c.laddr.ip for c in psutil.Process().net_connections("inet") if c.status == "LISTEN"})))
    manager.shutdown(wait=False)
    return weights


def train_beside_an_outsider(steps: int, work: str, shared: str) -> list[float]:
    """:func:`train`, once another user's process (tests/scripts/ft_outsider.py) has tried to join
    with the lighthouse address the ranks were given: group 0's rank writes it to
    ``shared/lighthouse``, and every rank waits for ``shared/outsider.started`` (with a deadline)."""

    if os.environ["REPLICA_GROUP_ID"] == "0":
        given = os.path.join(shared, "lighthouse")
        with open(given + ".tmp", "w") as fh:
            fh.write(os.environ["TORCHFT_LIGHTHOUSE"])
        os.chmod(given + ".tmp", 0o644)
        os.replace(given + ".tmp", given)
    started, deadline = os.path.join(shared, "outsider.started"), time.monotonic() + 60
    while not os.path.exists(started):
        if time.monotonic() > deadline:
            raise TimeoutError("the outsider did not try within 60 s (tests/scripts/ft_outsider.py)")
        time.sleep(0.05)
    return train(steps, work)
