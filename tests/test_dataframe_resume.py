"""A run resumed from a report() checkpoint trains every DataFrame row exactly once per epoch: its
loaders go on after the batch the checkpoint was reported at (same epoch, same shuffle order),
counting each life of the run only up to its last checkpoint. Before, a restarted rank's
rank_loader began the epoch again (issue 57: 1,000 of 2,000 rows trained twice in epoch 0).

Each rank appends what it trained to a file per life; DDP all-reduces every batch, so ranks that
resumed at different batches would hang (the run's timeout) rather than pass."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from spark_torch import DistributedRunError, Distributor
from spark_torch.reporting.storage import MANIFEST

ROWS, BATCH, EPOCHS = 2000, 50, 2  # 2 ranks: 20 batches per epoch each


def train_and_record(
    log_dir: str, tag: str, batch_size: int, shuffle: bool, num_workers: int, die_at: int | None
) -> None:
    """Two epochs of DDP on (id, x); a checkpoint every 10 batches (rank 0's files only); rank 1
    SIGKILLs itself after batch ``die_at`` of the first life. Logs every batch's ids by epoch."""
    import os
    import signal
    import tempfile
    import warnings

    import torch
    import torch.distributed as dist

    import spark_torch
    from spark_torch.data import rank_loader
    from spark_torch.rank.data import RankDataset

    dist.init_process_group("gloo", init_method="env://")
    rank, life = dist.get_rank(), int(os.environ["SPARK_TORCH_RESTART_COUNT"])
    log = open(os.path.join(log_dir, f"{tag}-life{life}-rank{rank}.jsonl"), "a")  # noqa: SIM115 - one per life

    def write(**row: Any) -> None:
        log.write(json.dumps(row) + "\n")
        log.flush()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        evaluation = rank_loader(7)  # made first: each loader keeps its own position, by creation order
        loader = rank_loader(batch_size, columns=["id", "x"], shuffle=shuffle, seed=3, num_workers=num_workers)
    reference = {}  # an uninterrupted epoch of this rank, batch by batch
    for epoch in range(EPOCHS):
        plain = RankDataset(
            os.environ["SPARK_TORCH_DATA_FILE"], batch_size=batch_size, columns=["id"], shuffle=shuffle, seed=3
        )
        plain.set_epoch(epoch)
        reference[epoch] = [i for b in plain for i in b["id"].tolist()]
    write(
        warnings=[str(w.message) for w in caught],
        start=[loader.epoch, loader.state_dict()["batch"]],
        reference=reference,
    )
    checkpoint = spark_torch.get_checkpoint()
    step = json.loads((checkpoint / "state.json").read_text())["step"] if checkpoint is not None else 0
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1).double())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for epoch in range(loader.epoch, EPOCHS):
        for ids, x in loader:
            loss = torch.nn.functional.mse_loss(model(x.unsqueeze(1)).squeeze(1), x)
            opt.zero_grad()
            loss.backward()  # DDP's all-reduce: every rank must run the same number of batches
            opt.step()
            step += 1
            write(epoch=epoch, ids=ids.tolist())
            if die_at == step and rank == 1 and life == 0:
                os.kill(os.getpid(), signal.SIGKILL)
            if step % 10 == 0:
                with tempfile.TemporaryDirectory() as tmp:
                    if rank == 0:
                        Path(tmp, "state.json").write_text(json.dumps({"step": step}))
                    spark_torch.report({"trained": step}, checkpoint=tmp if rank == 0 else None)
                write(checkpoint=step)
        next(iter(evaluation))  # one evaluation batch per epoch
    dist.destroy_process_group()


def lives(log_dir: Path, tag: str, rank: int) -> list[list[dict[str, Any]]]:
    found = sorted(
        log_dir.glob(f"{tag}-life*-rank{rank}.jsonl"), key=lambda p: int(p.name.split("life")[1].split("-")[0])
    )
    return [[json.loads(line) for line in path.read_text().splitlines()] for path in found]


def trained(rows: list[dict[str, Any]], last: bool) -> list[dict[str, Any]]:
    """A life's batches up to its last checkpoint (the last life: all of them)."""
    checkpoints = [i for i, row in enumerate(rows) if "checkpoint" in row]
    kept = rows if last else rows[: checkpoints[-1] if checkpoints else 0]
    return [row for row in kept if "ids" in row]


def check_exactly_once(log_dir: Path, tags: list[str], ranks: int, rows: int) -> list[dict[str, Any]]:
    """Per epoch: each rank trained its uninterrupted epoch's rows in its order, and the ranks
    together every row once. Returns each life's first line (warnings, start position)."""
    firsts = []
    every: dict[int, list[int]] = {e: [] for e in range(EPOCHS)}
    for rank in range(ranks):
        all_lives = [life for tag in tags for life in lives(log_dir, tag, rank)]
        assert len(all_lives) == 2, [len(life) for life in all_lives]
        firsts += [life[0] for life in all_lives]
        reference = {int(e): ids for e, ids in all_lives[-1][0]["reference"].items()}
        per_epoch: dict[int, list[int]] = {e: [] for e in range(EPOCHS)}
        for n, life in enumerate(all_lives):
            for row in trained(life, last=n == len(all_lives) - 1):
                per_epoch[row["epoch"]] += row["ids"]
        for epoch in range(EPOCHS):
            assert per_epoch[epoch] == reference[epoch], (rank, epoch, len(per_epoch[epoch]), len(reference[epoch]))
            every[epoch] += per_epoch[epoch]
    for epoch in range(EPOCHS):
        assert sorted(every[epoch]) == list(range(rows)), (epoch, len(every[epoch]))
    return firsts


def rows_df(spark: Any, rows: int = ROWS) -> Any:
    from pyspark.sql import functions as F

    # two partitions of equal size: round-robin gives two nodes 1,000 rows each (no padding)
    return spark.range(0, rows, 1, 2).withColumn("x", F.col("id").cast("double") / rows)


@pytest.mark.parametrize(
    "local_mode, shuffle, num_workers",
    [(True, True, 0), (True, False, 2), (False, True, 2), (False, False, 0)],
    ids=["local-shuffled", "local-in-order-2-workers", "distributed-shuffled-2-workers", "distributed-in-order"],
)
def test_a_rank_killed_mid_epoch_resumes_after_the_checkpoints_batch(
    spark_session: Any, tmp_path: Path, local_mode: bool, shuffle: bool, num_workers: int, no_leftovers: None
) -> None:
    """Checkpoint after batch 10 of a 20-batch epoch, rank 1 SIGKILLed after batch 13, the gang
    restarts (max_restarts=1): the second life goes on at batch 10 of epoch 0."""
    d = Distributor(
        num_processes=2,
        local_mode=local_mode,
        spark=spark_session,
        storage_path=tmp_path / "runs",
        max_restarts=1,
        timeout=240,
    )
    d.run_on_dataframe(train_and_record, rows_df(spark_session), str(tmp_path), "run", BATCH, shuffle, num_workers, 13)
    assert d.last_run is not None and d.last_run.restarts == 1 and d.last_run.checkpoint is not None
    kept = json.loads((Path(d.last_run.checkpoint) / MANIFEST).read_text())["loaders"]  # rank 1 passed no files
    assert sorted(kept) == ["0", "1"] and [(p["epoch"], p["batch"], p["batch_size"]) for p in kept["1"]] == [
        (1, 0, 7),
        (2, 0, BATCH),
    ]
    firsts = check_exactly_once(tmp_path, ["run"], 2, ROWS)
    assert [f["start"] for f in firsts] == [[0, 0], [0, 10]] * 2 and not any(f["warnings"] for f in firsts)


@pytest.mark.parametrize("change", ["world size", "DataFrame"])
def test_a_resumed_run_with_another_world_or_dataframe_restarts_the_epoch(
    spark_session: Any, tmp_path: Path, change: str, no_leftovers: None
) -> None:
    """A run out of restarts is resumed by a new run() of its run_id with 3 ranks instead of 2,
    or on a DataFrame of other rows: the checkpoint's positions do not apply; every rank warns
    and trains epoch 0 again from its first batch (the same batches on every rank: DDP in step)."""
    first = Distributor(num_processes=2, storage_path=tmp_path / "runs", run_id="grow", timeout=240)
    with pytest.raises(DistributedRunError, match="killed by SIGKILL"):
        first.run_on_dataframe(train_and_record, rows_df(spark_session), str(tmp_path), "a", BATCH, True, 0, 13)
    ranks, rows = (3, ROWS) if change == "world size" else (2, 1500)
    again = Distributor(num_processes=ranks, storage_path=tmp_path / "runs", run_id="grow", timeout=240)
    again.run_on_dataframe(train_and_record, rows_df(spark_session, rows), str(tmp_path), "b", BATCH, True, 0, None)
    named = "world_size 2 -> 3" if change == "world size" else "rows 2000 -> 1500"
    for rank in range(ranks):
        (life,) = lives(tmp_path, "b", rank)
        first_line, batches = life[0], trained(life, last=True)
        warned = [w for w in first_line["warnings"] if "data loader's position" in w]  # each of the two loaders
        assert len(warned) == 2 and all(named in w and "starts again from its first batch" in w for w in warned), warned
        assert first_line["start"] == [0, 0]
        reference = first_line["reference"]
        for epoch in range(EPOCHS):
            assert [i for row in batches if row["epoch"] == epoch for i in row["ids"]] == reference[str(epoch)]
