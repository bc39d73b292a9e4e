"""spark_torch.data on Arrow files made here (no Spark): conversion, sharding, shuffling."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from spark_torch.rank.columns import _vectors_to_dense, column_kind
from spark_torch.rank.data import RankDataset

VECTOR = pa.struct([("type", pa.int8()), ("size", pa.int32()), ("indices", pa.list_(pa.int32())), ("values", pa.list_(pa.float64()))])


def write(tmp_path: Path, rows: int, batch: int = 7) -> str:
    table = pa.table({"id": pa.array(range(rows), pa.int64()), "v": pa.array([[float(i), 1.0] for i in range(rows)])})
    path = str(tmp_path / "data.arrow")
    with pa.ipc.new_file(path, table.schema) as writer:
        for b in table.to_batches(max_chunksize=batch):
            writer.write_batch(b)
    return path


def ids(ds: RankDataset) -> list[int]:
    return [i for b in ds for i in b["id"].tolist()]


def test_sharding_is_exact_and_even(tmp_path: Path) -> None:
    path = write(tmp_path, 50)
    parts = [ids(RankDataset(path, batch_size=4, local_rank=r, local_world_size=3)) for r in range(3)]
    assert sorted(sum(parts, [])) == list(range(50))
    assert [len(p) for p in parts] == [17, 17, 16]
    assert RankDataset(path, batch_size=4, local_rank=0, local_world_size=3).num_rows() == 17


def test_shuffle_per_epoch_reproducible(tmp_path: Path) -> None:
    path = write(tmp_path, 40)
    ds = RankDataset(path, batch_size=5, shuffle=True, seed=3, local_rank=0, local_world_size=1)
    first, second = ids(ds), (ds.set_epoch(1), ids(ds))[1]
    ds.set_epoch(0)
    assert ids(ds) == first and first != second and sorted(first) == sorted(second) == list(range(40))


def test_drop_last_and_shapes(tmp_path: Path) -> None:
    path = write(tmp_path, 10)
    batches = list(RankDataset(path, batch_size=4, drop_last=True, local_rank=0, local_world_size=1))
    assert len(batches) == 2 and all(b["v"].shape == (4, 2) for b in batches)


def test_vectors_dense_and_sparse() -> None:
    rows = [{"type": 1, "size": None, "indices": None, "values": [1.0, 2.0, 3.0]},
            {"type": 0, "size": 3, "indices": [0, 2], "values": [5.0, 6.0]}]
    out = _vectors_to_dense(pa.array(rows, type=VECTOR))
    assert out.tolist() == [[1.0, 2.0, 3.0], [5.0, 0.0, 6.0]]


def test_unsupported_type_named() -> None:
    with pytest.raises(TypeError, match="unsupported column type map"):
        column_kind(pa.map_(pa.string(), pa.int32()))
