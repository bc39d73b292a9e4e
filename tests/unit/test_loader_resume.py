"""A loader's position (no Spark): counted as batches are handed out, sent by report(), read back
from a checkpoint's manifest in creation order, applied only to the same world and rows,
state_dict()/load_state_dict() by hand, in order with DataLoader workers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from spark_torch.node.staging import write_node_data
from spark_torch.rank import positions
from spark_torch.rank.data import RankDataset, rank_dataset, rank_loader
from spark_torch.reporting import loader_positions
from spark_torch.reporting.storage import MANIFEST

ROWS, BATCH = 40, 4  # 10 batches per epoch


@pytest.fixture
def staged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A rank of a one-rank world on 40 staged rows; its loaders forgotten afterwards."""
    table = pa.table({"id": pa.array(range(ROWS), pa.int64())})
    path, _ = write_node_data(table.to_batches(max_chunksize=7), str(tmp_path))
    for name, value in {
        "SPARK_TORCH_DATA_FILE": path,
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("SPARK_TORCH_CHECKPOINT", raising=False)
    monkeypatch.delenv("SPARK_TORCH_DATA_ROWS", raising=False)
    positions.forget()
    yield path
    positions.forget()
    loader_positions.track(None)


def ids(batches: Any) -> list[int]:
    return [i for b in batches for i in b["id"].tolist()]


def epoch_order(path: str, epoch: int, shuffle: bool = True) -> list[int]:
    ds = RankDataset(path, batch_size=BATCH, shuffle=shuffle, seed=5, local_rank=0, local_world_size=1)
    ds.set_epoch(epoch)
    return ids(ds)


def resume_from(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, saved: dict[str, Any]) -> None:
    """This rank now resumes from a checkpoint whose manifest keeps ``saved`` (rank -> positions)."""
    checkpoint = tmp_path / "checkpoint_000003"
    checkpoint.mkdir()
    (checkpoint / MANIFEST).write_text(json.dumps({"step": 3, "loaders": saved}))
    monkeypatch.setenv("SPARK_TORCH_CHECKPOINT", str(checkpoint))
    positions.forget()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_resumed_loader_goes_on_after_the_reported_batch(
    staged: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, num_workers: int
) -> None:
    """Batches 0-6 of epoch 1 were handed out when report() ran: the resumed loader hands out
    batches 7-9 of epoch 1 (the same shuffle order), then epoch 2 whole, in order with workers
    (from an odd batch: the DataLoader asks worker 0 first)."""
    loader = rank_loader(BATCH, shuffle=True, seed=5, num_workers=num_workers)
    list(loader)  # epoch 0
    it = iter(loader)
    first = [next(it) for _ in range(7)]
    assert ids(first) == epoch_order(staged, 1)[:28]
    sent = loader_positions.current()  # what report() sends now
    assert [(p["epoch"], p["batch"]) for p in sent] == [(1, 7)] and loader.epoch == 1
    del it
    resume_from(tmp_path, monkeypatch, {"0": sent})
    again = rank_loader(BATCH, shuffle=True, seed=5, num_workers=num_workers)
    assert again.epoch == 1
    assert ids(again) == epoch_order(staged, 1)[28:]
    assert again.epoch == 2 and ids(again) == epoch_order(staged, 2)


def test_a_report_at_the_end_of_an_epoch_resumes_at_the_next(
    staged: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    loader = rank_loader(BATCH)
    for _ in loader:
        pass
    sent = loader_positions.current()
    assert [(p["epoch"], p["batch"]) for p in sent] == [(1, 0)]
    resume_from(tmp_path, monkeypatch, {"0": sent})
    assert rank_loader(BATCH).epoch == 1


def test_several_loaders_each_keep_their_own_by_creation_order(
    staged: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    train, evaluate = rank_loader(BATCH), rank_loader(8)
    it = iter(train)
    for _ in range(3):
        next(it)
    next(iter(evaluate))  # a loop left early: the next iter() is the next epoch
    sent = loader_positions.current()
    assert [(p["epoch"], p["batch"], p["batch_size"]) for p in sent] == [(0, 3, 4), (1, 0, 8)]
    resume_from(tmp_path, monkeypatch, {"0": sent})
    train, evaluate, third = rank_loader(BATCH), rank_loader(8), rank_loader(BATCH)
    assert ids(train) == list(range(12, ROWS)) and evaluate.epoch == 1 and ids(third) == list(range(ROWS))


def test_epochs_per_iteration_resume_inside_the_iteration(
    staged: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """epochs=3: one iter() is 3 epochs; a report in the second goes on there, to the third's end."""
    loader = rank_loader(BATCH, shuffle=True, seed=5, epochs=3)
    it = iter(loader)
    for _ in range(13):
        next(it)
    sent = loader_positions.current()
    assert [(p["epoch"], p["batch"]) for p in sent] == [(1, 3)]
    del it
    resume_from(tmp_path, monkeypatch, {"0": sent})
    assert ids(rank_loader(BATCH, shuffle=True, seed=5, epochs=3)) == epoch_order(staged, 1)[12:] + epoch_order(
        staged, 2
    )


def test_rank_dataset_resumes_in_its_epoch(staged: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ds = rank_dataset(BATCH)
    ds.inner.set_epoch(2)
    it = iter(ds)
    for _ in range(4):
        next(it)
    state = ds.state_dict()
    assert (state["epoch"], state["batch"]) == (2, 4)
    sent = loader_positions.current()
    del it  # left early: the next iteration would start afresh
    assert (ds.state_dict()["epoch"], ds.state_dict()["batch"]) == (3, 0)
    resume_from(tmp_path, monkeypatch, {"0": sent})
    again = rank_dataset(BATCH)
    assert again.inner.epoch == 2 and ids(again) == list(range(16, ROWS))
    assert ids(again) == list(range(ROWS))  # iterated again, the same epoch (set_epoch not called): whole
    again.load_state_dict(state)  # by hand
    assert again.inner.epoch == 2 and ids(again) == list(range(16, ROWS))


def test_rank_dataset_in_your_own_dataloader_with_workers_warns(staged: str) -> None:
    """In a fresh interpreter (pytest records the warnings of the workers it forks)."""
    program = (
        "from torch.utils.data import DataLoader\n"
        "from spark_torch.data import rank_dataset\n"
        "for _ in range(2):\n"
        "    print(sum(len(b['id']) for b in DataLoader(rank_dataset(4), batch_size=None, num_workers=2)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=120, env=dict(os.environ)
    )
    assert done.returncode == 0 and done.stdout.split() == [str(ROWS)] * 2, done.stderr
    assert done.stderr.count("cannot record its position for a resumed run") == 2, (
        done.stderr
    )  # in the first worker of each iteration


def test_rows_with_other_values_but_the_same_counts_are_not_noticed(
    staged: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check is by row counts (reading the values would cost a pass over the data)."""
    it = iter(rank_loader(BATCH))
    next(it)
    sent = loader_positions.current()
    other = tmp_path / "other"
    path, _ = write_node_data(pa.table({"id": pa.array(range(100, 100 + ROWS), pa.int64())}).to_batches(), str(other))
    monkeypatch.setenv("SPARK_TORCH_DATA_FILE", path)
    resume_from(tmp_path, monkeypatch, {"0": sent})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ids(rank_loader(BATCH)) == list(range(104, 100 + ROWS))


def test_another_world_or_other_rows_restart_the_epoch_with_a_warning(
    staged: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    it = iter(rank_loader(BATCH))
    for _ in range(5):
        next(it)
    (sent,) = loader_positions.current()
    changes = [
        ({"world_size": 2}, "world_size 2 -> 1"),
        ({"rows": 41}, "rows 41 -> 40"),
        ({"batch_size": 5}, "batch_size 5 -> 4"),
        ({"shuffle": True}, "shuffle True -> False"),
        ({"window": 7}, "window 7 -> 0"),  # a shuffled epoch's order depends on the window size
    ]
    for number, (change, named) in enumerate(changes):
        (tmp_path / str(number)).mkdir()
        resume_from(tmp_path / str(number), monkeypatch, {"0": [{**sent, "epoch": 3, **change}]})
        with pytest.warns(
            UserWarning,
            match=rf"epoch 3, batch 5\) was recorded for another run's data or world \({named}\): "
            r"epoch 3 starts again from its first batch",
        ):
            loader = rank_loader(BATCH)
        assert loader.epoch == 3 and ids(loader) == list(range(ROWS))


def test_a_rank_the_checkpoint_holds_none_for_takes_the_lowest_ranks_position(
    staged: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0 finds only ranks 1 and 2's positions: in the same world it goes on at theirs (DDP
    kept the ranks in step); in a world that grew, every rank starts their epoch again."""
    it = iter(rank_loader(BATCH))
    next(it)
    (sent,) = loader_positions.current()
    saved = {"1": [{**sent, "epoch": 4, "batch": 6, "rank": 1}], "2": [{**sent, "epoch": 4, "batch": 6, "rank": 2}]}
    resume_from(tmp_path, monkeypatch, saved)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loader = rank_loader(BATCH)
    assert (loader.epoch, loader.state_dict()["batch"]) == (4, 6)
    grown = tmp_path / "grown"
    grown.mkdir()
    resume_from(grown, monkeypatch, {k: [{**v[0], "world_size": 3}] for k, v in saved.items()})
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.warns(UserWarning, match=r"\(world_size 3 -> 4\): epoch 4 starts again from its first batch"):
        loader = rank_loader(BATCH)
    assert (loader.epoch, loader.state_dict()["batch"]) == (4, 0)


def test_state_dict_by_hand_and_a_bad_state(staged: str) -> None:
    loader = rank_loader(BATCH, shuffle=True, seed=5)
    it = iter(loader)
    for _ in range(7):
        next(it)
    state = json.loads(json.dumps(loader.state_dict()))  # JSON, as a checkpoint by hand keeps it
    other = rank_loader(BATCH, shuffle=True, seed=5)
    other.load_state_dict(state)
    assert ids(other) == epoch_order(staged, 0)[28:]
    for bad in [None, {"epoch": 1}, {"epoch": -1, "batch": 0}, {"epoch": True, "batch": 0}]:
        with pytest.raises(
            ValueError, match=r"is not a data loader's position; pass what the loader's state_dict\(\) returned"
        ):
            other.load_state_dict(bad)  # type: ignore[arg-type]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        other.load_state_dict(state)  # the same run's: no warning


def test_report_sends_positions_and_the_manifest_keeps_every_ranks(tmp_path: Path) -> None:
    """The node forwards its ranks' positions by rank (also a rank that passed no checkpoint);
    the driver's manifest keeps them; a malformed node message is refused."""
    from spark_torch.reporting.coordinator import ReportCoordinator
    from spark_torch.reporting.pipes import NodeReports
    from spark_torch.reporting.storage import RunStorage

    storage = RunStorage(str(tmp_path), "run", None)
    storage.create("token")
    (tmp_path / "run" / "checkpoint_000001").mkdir()
    answers: list[Any] = []
    coordinator = ReportCoordinator(
        1, 0, storage, on_row=lambda row: None, answer=lambda step, error: answers.append((step, error))
    )
    forwarded: list[dict[str, Any]] = []
    node = NodeReports(0, [0, 1], forward=lambda m: (forwarded.append(m), coordinator.node_report(0, m)))
    node._arrived(0, 1, {"step": 1, "metrics": {}, "checkpoint": True, "loaders": [{"epoch": 0, "batch": 3}]})
    node._arrived(1, 1, {"step": 1, "metrics": None, "checkpoint": False, "loaders": [{"epoch": 0, "batch": 3}]})
    coordinator.close()
    assert forwarded[0]["loaders"] == {"0": [{"epoch": 0, "batch": 3}], "1": [{"epoch": 0, "batch": 3}]}
    assert answers == [(1, None)]
    manifest = json.loads((tmp_path / "run" / "checkpoint_000001" / MANIFEST).read_text())
    assert manifest["loaders"] == forwarded[0]["loaders"]
    with pytest.raises(ValueError, match="loaders must be an object of rank -> list of positions"):
        loader_positions.checked({"0": "x"})


def test_a_loader_that_is_gone_keeps_its_number_and_too_many_are_not_kept(
    staged: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A loader made per epoch and dropped is None in what report() sends (the next one keeps its
    own number); positions over MAX_BYTES are not sent, with a warning (report() goes on)."""
    import gc

    first = rank_loader(BATCH)
    del first
    gc.collect()
    kept = rank_loader(BATCH)
    it = iter(kept)
    next(it)
    sent = loader_positions.current()
    assert sent[0] is None and (sent[1]["epoch"], sent[1]["batch"]) == (0, 1)  # type: ignore[index]
    resume_from(tmp_path, monkeypatch, {"0": sent})
    assert ids(rank_loader(BATCH)) == list(range(ROWS)) and ids(rank_loader(BATCH)) == list(range(BATCH, ROWS))
    monkeypatch.setattr(loader_positions, "MAX_BYTES", 100)
    with pytest.warns(UserWarning, match="data loaders' positions take more than 100 bytes: report\\(\\) keeps none"):
        assert loader_positions.current() == []
