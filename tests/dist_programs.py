"""Rank-side torch.distributed programs run by tests/test_collectives.py through the Distributor.

Each function is called on every rank with the torchrun environment contract (RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...). It initialises a gloo process group from the
environment, runs its communication, destroys the group and returns plain Python data.
Only rank 0's return value reaches the driver, so the functions all_gather every rank's
results first and rank 0 returns them all.

They import torch inside the function body: this module is shipped by value to the ranks.
"""

from __future__ import annotations

from typing import Any


def _ring_all_reduce(tensor: Any) -> Any:
    """Sum ``tensor`` over all ranks with a ring (reduce-scatter then all-gather) built on send/recv.

    Returns a new tensor; ``tensor`` is left untouched. Even ranks send before receiving and odd
    ranks receive before sending, so blocking send/recv cannot deadlock.
    """
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world, (rank - 1) % world
    chunks = list(torch.tensor_split(tensor.clone(), world))
    incoming = [torch.empty_like(c) for c in chunks]

    def exchange(send_idx: int, recv_idx: int) -> None:
        if rank % 2 == 0:
            dist.send(chunks[send_idx], dst=right)
            dist.recv(incoming[recv_idx], src=left)
        else:
            dist.recv(incoming[recv_idx], src=left)
            dist.send(chunks[send_idx], dst=right)

    # reduce-scatter: after world-1 steps, chunk (rank + 1) % world holds the full sum here
    for step in range(world - 1):
        send_idx, recv_idx = (rank - step) % world, (rank - step - 1) % world
        exchange(send_idx, recv_idx)
        chunks[recv_idx] = chunks[recv_idx] + incoming[recv_idx]
    # all-gather: pass the finished chunks around the ring
    for step in range(world - 1):
        send_idx, recv_idx = (rank - step + 1) % world, (rank - step) % world
        exchange(send_idx, recv_idx)
        chunks[recv_idx] = incoming[recv_idx].clone()
    return torch.cat(chunks)


def all_collectives() -> dict[int, dict[str, Any]]:
    """Point-to-point, every collective and a hand-written ring all-reduce, in sequence.

    Returns (on rank 0) ``{rank: {name: value}}`` for every rank; the values are lists of ints
    (or plain ints/bools), deterministic functions of the rank and world size, so the test can
    compute the expected values itself.
    """
    import os

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        out: dict[str, Any] = {
            "rank": rank,
            "world_size": world,
            "env_rank": int(os.environ["RANK"]),
            "env_world_size": int(os.environ["WORLD_SIZE"]),
            "backend": str(dist.get_backend()),
        }

        # --- point-to-point, blocking: 0 -> 1, then 1 -> 0 (doubled) ---
        if rank == 0:
            dist.send(torch.tensor([1, 2, 3], dtype=torch.int64), dst=1)
            back = torch.zeros(3, dtype=torch.int64)
            dist.recv(back, src=1)
            out["send_recv"] = back.tolist()
        elif rank == 1:
            got = torch.zeros(3, dtype=torch.int64)
            sender = dist.recv(got, src=0)
            out["send_recv"] = got.tolist()
            out["recv_sender"] = int(sender)
            dist.send(got * 2, dst=0)

        # --- point-to-point, non-blocking: every rank sends to and receives from its neighbours ---
        peer_to, peer_from = (rank + 1) % world, (rank - 1) % world
        outgoing = torch.full((4,), 10 * (rank + 1), dtype=torch.int64)
        incoming = torch.zeros(4, dtype=torch.int64)
        requests = [dist.isend(outgoing, dst=peer_to), dist.irecv(incoming, src=peer_from)]
        for request in requests:
            request.wait()
        out["isend_irecv"] = incoming.tolist()

        # --- broadcast from rank 0 ---
        t = torch.arange(4, dtype=torch.int64) * 7 if rank == 0 else torch.zeros(4, dtype=torch.int64)
        dist.broadcast(t, src=0)
        out["broadcast"] = t.tolist()

        # --- reduce (sum) to rank 0 ---
        t = torch.tensor([rank + 1, 10 * (rank + 1)], dtype=torch.int64)
        dist.reduce(t, dst=0, op=dist.ReduceOp.SUM)
        if rank == 0:
            out["reduce"] = t.tolist()

        # --- all_reduce: sum, max, product ---
        for name, op in (("sum", dist.ReduceOp.SUM), ("max", dist.ReduceOp.MAX), ("product", dist.ReduceOp.PRODUCT)):
            t = torch.tensor([rank + 1, rank + 2], dtype=torch.int64)
            dist.all_reduce(t, op=op)
            out[f"all_reduce_{name}"] = t.tolist()

        # --- scatter from rank 0: rank i gets [100 * i, 100 * i + 1] ---
        received = torch.zeros(2, dtype=torch.int64)
        scatter_list = (
            [torch.tensor([100 * i, 100 * i + 1], dtype=torch.int64) for i in range(world)] if rank == 0 else None
        )
        dist.scatter(received, scatter_list=scatter_list, src=0)
        out["scatter"] = received.tolist()

        # --- gather to rank 0 ---
        mine = torch.tensor([rank, rank * rank], dtype=torch.int64)
        gather_list = [torch.zeros(2, dtype=torch.int64) for _ in range(world)] if rank == 0 else None
        dist.gather(mine, gather_list=gather_list, dst=0)
        if rank == 0:
            out["gather"] = [g.tolist() for g in gather_list]

        # --- all_gather ---
        parts = [torch.zeros(3, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(parts, torch.full((3,), rank + 5, dtype=torch.int64))
        out["all_gather"] = [p.tolist() for p in parts]

        # --- barrier ---
        dist.barrier()
        out["barrier"] = True

        # --- new_group: a sub-group of rank 1 alone, and an explicit group of all ranks ---
        # new_group must be entered by every rank, members or not.
        solo = dist.new_group(ranks=[world - 1])
        pair = dist.new_group(ranks=list(range(world)))
        out["solo_group_rank"] = dist.get_rank(group=solo)  # -1 where not a member
        if rank == world - 1:
            t = torch.tensor([rank + 40], dtype=torch.int64)
            dist.all_reduce(t, group=solo)  # a group of one: unchanged
            out["solo_all_reduce"] = t.tolist()
            out["solo_group_size"] = dist.get_world_size(group=solo)
        t = torch.tensor([rank + 3], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.PRODUCT, group=pair)
        out["pair_all_reduce_product"] = t.tolist()
        out["pair_group_size"] = dist.get_world_size(group=pair)
        dist.destroy_process_group(solo)
        dist.destroy_process_group(pair)

        # --- hand-written ring all-reduce over send/recv, checked against dist.all_reduce ---
        data = torch.arange(10, dtype=torch.int64) * (rank + 1) + rank
        ring = _ring_all_reduce(data)
        reference = data.clone()
        dist.all_reduce(reference)
        out["ring_all_reduce"] = ring.tolist()
        out["ring_matches_all_reduce"] = bool(torch.equal(ring, reference))

        # every rank's results, so the driver sees the non-zero ranks too
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, out)
        return {int(r["rank"]): r for r in gathered}
    finally:
        dist.destroy_process_group()


def _mlp(seed: int) -> Any:
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()


def _synthetic_data() -> tuple[Any, Any]:
    import torch

    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(32, 4, generator=gen, dtype=torch.float64)
    y = (x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]], dtype=torch.float64)) + 0.1
    return x, y


def _checksum(model: Any) -> float:
    """A position-sensitive checksum of all parameters (so swapped values change it)."""
    import torch

    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    weights = torch.arange(1, flat.numel() + 1, dtype=flat.dtype)
    return float((flat * weights).sum())


def ddp_training(steps: int = 5, lr: float = 0.1) -> dict[str, Any]:
    """A few SGD steps of a tiny MLP under DistributedDataParallel, data split by rank.

    Each rank initialises its model from a different seed: DDP must broadcast rank 0's weights
    at construction and average gradients, so the replicas end identical. Rank 0 also trains
    the same model single-process on the full data (DDP on equal shards with a mean loss is
    the same as full-batch SGD) as a reference.

    Returns (on rank 0) ``checksums`` (one per rank, all_gathered), ``identical`` (the
    flattened parameters are bit-identical on every rank), ``losses`` (rank 0's per-step
    local loss) and ``reference_checksum``.
    """
    import gc

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    model = opt = None
    dist.init_process_group("gloo", init_method="env://")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        torch.set_num_threads(1)
        x, y = _synthetic_data()
        shard_x, shard_y = x.chunk(world)[rank], y.chunk(world)[rank]

        model = DistributedDataParallel(_mlp(seed=rank))
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        losses = []
        for _ in range(steps):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(shard_x), shard_y)
            loss.backward()
            opt.step()
            losses.append(loss.item())

        checksum = torch.tensor([_checksum(model.module)], dtype=torch.float64)
        checksums = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
        dist.all_gather(checksums, checksum)

        flat = torch.cat([p.detach().flatten() for p in model.module.parameters()])
        flats = [torch.zeros_like(flat) for _ in range(world)]
        dist.all_gather(flats, flat)
        identical = all(torch.equal(f, flats[0]) for f in flats)

        result: dict[str, Any] = {
            "checksums": [float(c) for c in checksums],
            "identical": bool(identical),
            "losses": losses,
        }
        if rank == 0:
            reference = _mlp(seed=0)
            ref_opt = torch.optim.SGD(reference.parameters(), lr=lr)
            for _ in range(steps):
                ref_opt.zero_grad()
                torch.nn.functional.mse_loss(reference(x), y).backward()
                ref_opt.step()
            result["reference_checksum"] = _checksum(reference)
            result["initial_checksum_rank0"] = _checksum(_mlp(seed=0))
        return result
    finally:
        # Free the DDP wrapper (it sits in reference cycles, so only the collector frees it)
        # while its process group still exists. Left to interpreter shutdown, the rank that
        # exits first intermittently dies with "terminate called without an active exception"
        # (SIGABRT) after returning -- seen with plain subprocesses too, without spark_torch.
        model = opt = None
        gc.collect()
        dist.destroy_process_group()
