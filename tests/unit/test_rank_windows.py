"""A rank reads its epoch window by window (spark_torch.rank.windows, no Spark): every row once,
the two-level shuffle, and a rank's memory bounded by one window whatever the rows it owns."""

from __future__ import annotations

import gc
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from spark_torch.node.staging import write_node_data
from spark_torch.rank import windows
from spark_torch.rank.data import RankDataset, rank_positions
from spark_torch.rank.windows import BLOCKS_PER_WINDOW, EpochWindows, file_ranges, window_rows
from spark_torch.shared.column_files import StagedColumns

VECTOR = pa.struct(
    [("type", pa.int8()), ("size", pa.int32()), ("indices", pa.list_(pa.int32())), ("values", pa.list_(pa.float64()))]
)


def every_kind(tmp_path: Path, rows: int) -> str:
    """Rows of every column kind, each row's values derived from its id (so a row read from the
    wrong place, or rebased wrongly, shows)."""
    ids = np.arange(rows)
    dense = ids % 2 == 0
    vectors = [
        {"type": 1, "size": None, "indices": None, "values": [float(i)] * 3}
        if d
        else {"type": 0, "size": 3, "indices": [i % 3], "values": [float(i)]}
        for i, d in zip(ids.tolist(), dense.tolist())
    ]
    table = pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "fixed": pa.array([[float(i)] * 4 for i in ids.tolist()], pa.list_(pa.float32())),
            "ragged": pa.array([[i] * (i % 5) for i in ids.tolist()], pa.list_(pa.int64())),
            "vec": pa.array(vectors, VECTOR),
            "name": pa.array([None if i % 7 == 3 else "x" * (i % 4) + str(i) for i in ids.tolist()]),
            "blob": pa.array([str(i).encode() * (i % 3) for i in ids.tolist()], pa.binary()),
        }
    )
    path, written = write_node_data(table.to_batches(max_chunksize=997), str(tmp_path))
    assert written == rows
    return path


def check_rows(batch: dict[str, object]) -> list[int]:
    """The batch's ids, after checking every other column against them."""
    got = batch["id"].tolist()  # type: ignore[attr-defined]
    assert batch["fixed"].tolist() == [[float(i)] * 4 for i in got]  # type: ignore[attr-defined]
    assert [t.tolist() for t in batch["ragged"]] == [[i] * (i % 5) for i in got]  # type: ignore[attr-defined]
    dense = batch["vec"].numpy()  # type: ignore[attr-defined]
    for row, i in zip(dense.tolist(), got):
        assert row == ([float(i)] * 3 if i % 2 == 0 else [float(i) if k == i % 3 else 0.0 for k in range(3)])
    assert batch["name"] == [None if i % 7 == 3 else "x" * (i % 4) + str(i) for i in got]
    assert batch["blob"] == [str(i).encode() * (i % 3) for i in got]
    return got  # type: ignore[no-any-return]


@pytest.mark.parametrize("shuffle", [True, False], ids=["shuffled", "in-order"])
@pytest.mark.parametrize(
    ("rank", "ranks", "rows_per_node", "drop_last"),
    [(0, 1, None, False), (1, 2, [3001, 4100], False), (0, 3, [3001, 2000], True)],
    ids=["one-rank", "wraps-around", "drop-last"],
)
def test_a_windowed_epoch_holds_every_row_once(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    shuffle: bool,
    rank: int,
    ranks: int,
    rows_per_node: list[int] | None,
    drop_last: bool,
) -> None:
    """Windows of a few batches (each read with pread, its nested columns rebased): each row of
    the epoch once, with its own values, in file order when not shuffled."""
    path = every_kind(tmp_path, 3001)
    monkeypatch.setattr(windows, "WINDOW_BYTES", 4096)
    ds = RankDataset(
        path,
        batch_size=50,
        shuffle=shuffle,
        seed=5,
        local_rank=rank,
        local_world_size=ranks,
        rows_per_node=rows_per_node,
        drop_last=drop_last,
    )
    assert ds.window_rows() < ds.num_rows() // 4  # several windows
    got = [i for batch in ds for i in check_rows(batch)]
    expected = rank_positions(3001, rank, ranks, rows_per_node, drop_last)
    if drop_last:
        assert len(got) == len(expected) - len(expected) % 50 and len(set(got)) == len(got)
        assert set(got) <= set(expected)
    else:
        assert sorted(got) == sorted(expected)  # a rank that wraps around repeats its first rows, as before
    if not shuffle:
        assert got == expected[: len(got)]


def test_the_shuffle_is_fixed_by_seed_and_epoch_and_mixes_the_rows(tmp_path: Path) -> None:
    """Two-level: a window's rows come from BLOCKS_PER_WINDOW stretches scattered over the rank's
    rows, in an order seeded by (seed, epoch); a rank whose rows fit in one window gets them all."""
    epoch = EpochWindows(102_400, 10_240, True, 3, 0)
    assert len(epoch) == 10
    stretches = [epoch.rows(w) for w in range(len(epoch))]
    assert sorted(i for ranges in stretches for a, b in ranges for i in range(a, b)) == list(range(102_400))
    assert all(BLOCKS_PER_WINDOW <= len(ranges) <= BLOCKS_PER_WINDOW + 1 for ranges in stretches)
    first = stretches[0]
    assert max(b for _, b in first) - min(a for a, _ in first) > 51_200  # scattered, not one stretch
    assert first == EpochWindows(102_400, 10_240, True, 3, 0).rows(0)
    assert first != EpochWindows(102_400, 10_240, True, 3, 1).rows(0)
    assert first != EpochWindows(102_400, 10_240, True, 4, 0).rows(0)
    order = epoch.order(0)
    assert (np.diff(order) != 1).mean() > 0.99  # the window's rows permuted, not stretch by stretch
    assert (
        sorted(order.tolist()) == list(range(10_240))
        and (order == EpochWindows(102_400, 10_240, True, 3, 0).order(0)).all()
    )
    assert EpochWindows(102_400, 10_240, False, 3, 0).rows(3) == [(30_720, 40_960)]
    # the window: whole batches, about WINDOW_BYTES of rows, at least a batch, at most the epoch
    assert window_rows(128.0, 1024, 2_000_000) == (windows.WINDOW_BYTES // (128 * 1024)) * 1024
    assert window_rows(10**7, 1024, 2_000_000) == 1024
    assert window_rows(8.0, 1024, 5000) == 5120
    assert len(EpochWindows(5000, 5120, True, 0, 0)) == 1


def test_file_ranges_cut_where_a_rank_wraps_around() -> None:
    class Sharding:
        first, own, count = 100, 10, 25

    assert file_ranges([(5, 23), (0, 2)], Sharding()) == [(105, 110), (100, 110), (100, 103), (100, 102)]


def test_read_is_the_rows_of_the_ranges_in_order(tmp_path: Path) -> None:
    staged = StagedColumns(every_kind(tmp_path, 500))
    rows = staged.read(staged.names, [(450, 500), (0, 3), (200, 201), (7, 7)])
    assert rows.rows == 54
    want = list(range(450, 500)) + [0, 1, 2, 200]
    for name in staged.names:
        a, b = rows.gather(name, np.arange(54)), staged.gather(name, np.array(want))
        assert a.keys() == b.keys()
        for part in a:
            assert np.array_equal(np.asarray(a[part]), np.asarray(b[part])), (name, part)


def _resident_kb() -> int:
    fields = dict(line.split(":", 1) for line in open("/proc/self/status") if line.startswith(("RssAnon", "RssFile")))
    return sum(int(value.split()[0]) for value in fields.values())


def test_a_rank_holds_one_window_of_its_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The resident memory of a rank iterating 40 MB of rows grows by about one window (2 MiB
    here), not by the rows: its pages are read, never mapped (mapped, each counted in the RSS
    while mapped: at 4M rows a rank peaked at 1.29x PySpark's loader's)."""
    rows = 300_000

    def stage(where: Path, count: int) -> str:
        table = pa.table(
            {
                "features": pa.FixedSizeListArray.from_arrays(
                    pa.array(np.random.default_rng(0).random(count * 32, dtype=np.float32)), 32
                ).cast(pa.list_(pa.float32())),
                "label": pa.array(np.arange(count, dtype=np.float64)),
            }
        )
        return write_node_data(table.to_batches(max_chunksize=10_000), str(where))[0]

    path, small = stage(tmp_path / "big", rows), stage(tmp_path / "small", 1000)
    monkeypatch.setattr(windows, "WINDOW_BYTES", 2 * 2**20)
    for shuffle in (True, False):
        # imports and first allocations on other rows (a first batch of these would read a window of them)
        for _ in RankDataset(small, batch_size=256, shuffle=shuffle, local_rank=0, local_world_size=1):
            pass
        gc.collect()
        before = peak = _resident_kb()
        seen = 0
        for batch in RankDataset(path, batch_size=256, shuffle=shuffle, local_rank=0, local_world_size=1):
            seen += len(batch["label"])
            peak = max(peak, _resident_kb())
        assert seen == rows
        # 40 MB of rows; one window is 2 MiB; the rest is a batch and the allocator's slack
        assert (peak - before) / 1024 < 12, (
            f"shuffle={shuffle}: resident memory grew by {(peak - before) / 1024:.0f} MB"
        )
