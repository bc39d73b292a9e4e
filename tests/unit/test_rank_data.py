"""spark_torch.data on column folders staged here (no Spark): conversion, sharding, shuffling, dtypes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch

from spark_torch.node.staging import write_node_data
from spark_torch.rank.data import RankDataset, rank_positions
from spark_torch.shared.column_files import ColumnWriter, NullValuesError, StagedColumns, column_kind

VECTOR = pa.struct(
    [("type", pa.int8()), ("size", pa.int32()), ("indices", pa.list_(pa.int32())), ("values", pa.list_(pa.float64()))]
)


def write(tmp_path: Path, rows: int, batch: int = 7) -> str:
    table = pa.table({"id": pa.array(range(rows), pa.int64()), "v": pa.array([[float(i), 1.0] for i in range(rows)])})
    path, written = write_node_data(table.to_batches(max_chunksize=batch), str(tmp_path))
    assert written == rows
    return path


def ids(ds: RankDataset) -> list[int]:
    return [i for b in ds for i in b["id"].tolist()]


def test_sharding_is_exact_and_even(tmp_path: Path) -> None:
    path = write(tmp_path, 50)
    parts = [ids(RankDataset(path, batch_size=4, local_rank=r, local_world_size=3)) for r in range(3)]
    assert sorted(sum(parts, [])) == list(range(50))
    assert [len(p) for p in parts] == [17, 17, 16]
    assert RankDataset(path, batch_size=4, local_rank=0, local_world_size=3).num_rows() == 17


def test_batches_follow_rank_positions_padded_and_cut(tmp_path: Path) -> None:
    """The batches are exactly rank_positions' rows, in order, when shares are padded or cut."""
    path = write(tmp_path, 11)
    for drop_last in (False, True):
        for rank in range(2):
            ds = RankDataset(
                path, batch_size=4, local_rank=rank, local_world_size=2, rows_per_node=[11, 15], drop_last=drop_last
            )
            expected = rank_positions(11, rank, 2, [11, 15], drop_last)
            got = ids(ds)
            assert got == (expected[: len(expected) - len(expected) % 4] if drop_last else expected)
            assert len(expected) == (5 if drop_last else 8)


def test_each_rank_owns_one_contiguous_block_of_its_nodes_rows() -> None:
    """A rank reads only its own pages of the memory-mapped files (with every second row, both
    ranks of a node touched every page: at 4M rows a rank's RSS was 1.22x PySpark's loader's)."""
    blocks = [rank_positions(11, rank, 3, None, False) for rank in range(3)]
    assert blocks == [list(range(0, 4)), list(range(4, 8)), list(range(8, 11))]
    padded = rank_positions(11, 2, 3, [11, 12], False)  # node 1's ranks own 4 rows each: rank 2 wraps within its block
    assert padded == [8, 9, 10, 8]


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
    assert batches[0]["v"].dtype == torch.float32 and batches[0]["id"].dtype == torch.int64


def every_type_table(rows: int) -> pa.Table:
    vectors = [
        {"type": 1, "size": None, "indices": None, "values": [float(i), 2.0, 3.0]}
        if i % 2
        else {"type": 0, "size": 4, "indices": [0, 3], "values": [float(i), 6.0]}
        for i in range(rows)
    ]
    return pa.table(
        {
            "id": pa.array(range(rows), pa.int64()),
            "flag": pa.array([i % 3 == 0 for i in range(rows)]),
            "x": pa.array([i / 10 for i in range(rows)], pa.float64()),
            "fixed": pa.array([[i, -i] for i in range(rows)], pa.list_(pa.int32(), 2)),
            "ragged": pa.array([[float(i)] * (i % 3) for i in range(rows)], pa.list_(pa.float64())),
            "vec": pa.array(vectors, VECTOR),
            "name": pa.array([None if i == 4 else f"row{i}é" for i in range(rows)], pa.string()),
            "blob": pa.array([bytes([i % 256]) * (i % 4) for i in range(rows)], pa.large_binary()),
        }
    )


def test_every_type_round_trips_in_any_order(tmp_path: Path) -> None:
    table = every_type_table(30)
    # a sliced batch (offset into its buffers) must be staged from its own rows only
    batches = [table.slice(0, 9).to_batches()[0], table.slice(9, 13).to_batches()[0], table.slice(22).to_batches()[0]]
    path, _ = write_node_data(batches, str(tmp_path))
    ds = RankDataset(
        path, batch_size=30, shuffle=True, seed=1, local_rank=0, local_world_size=1, dtype={"vec": torch.float64}
    )
    (batch,) = list(ds)
    order = batch["id"].tolist()
    assert sorted(order) == list(range(30)) and order != list(range(30))
    for pos, i in enumerate(order):
        assert batch["flag"][pos].item() == (i % 3 == 0) and batch["x"][pos].item() == pytest.approx(i / 10)
        assert batch["fixed"][pos].tolist() == [i, -i] and batch["ragged"][pos].tolist() == [float(i)] * (i % 3)
        expected_vec = [float(i), 2.0, 3.0, 0.0] if i % 2 else [float(i), 0.0, 0.0, 6.0]
        assert batch["vec"][pos].tolist() == expected_vec
        assert batch["name"][pos] == (None if i == 4 else f"row{i}é")
        assert batch["blob"][pos] == bytes([i]) * (i % 4)
    assert batch["vec"].dtype == torch.float64 and batch["flag"].dtype == torch.bool
    assert batch["fixed"].dtype == torch.int32 and batch["x"].dtype == torch.float64


def test_dtype_default_one_and_per_column(tmp_path: Path) -> None:
    path, _ = write_node_data(every_type_table(6).to_batches(), str(tmp_path))

    def first(dtype: Any) -> dict[str, Any]:
        return next(iter(RankDataset(path, batch_size=6, local_rank=0, local_world_size=1, dtype=dtype)))

    default = first(None)
    assert (default["vec"].dtype, default["ragged"][1].dtype, default["x"].dtype, default["fixed"].dtype) == (
        torch.float32,
        torch.float32,
        torch.float64,
        torch.int32,
    )
    one = first(torch.float64)
    assert (one["vec"].dtype, one["ragged"][1].dtype, one["x"].dtype, one["id"].dtype) == (
        torch.float64,
        torch.float64,
        torch.float64,
        torch.int64,
    )
    per = first({"x": torch.float32, "id": torch.float32})
    assert (per["x"].dtype, per["id"].dtype, per["vec"].dtype) == (torch.float32, torch.float32, torch.float32)
    with pytest.raises(ValueError, match=r"dtype names columns \['nope'\] that the batches do not have"):
        first({"nope": torch.float32})
    with pytest.raises(ValueError, match=r"dtype names \['name'\], which are strings or bytes"):
        first({"name": torch.float32})
    with pytest.raises(ValueError, match=r"dtype\['x'\] must be a torch dtype such as torch.float32"):
        first({"x": "float32"})


@pytest.mark.parametrize("column", ["x", "fixed", "vec"])
def test_nulls_refused_while_staging_naming_the_column(tmp_path: Path, column: str) -> None:
    table = every_type_table(5)
    values = table.column(column).to_pylist()
    values[3] = None
    table = table.set_column(
        table.schema.get_field_index(column),
        table.schema.field(column),
        pa.array(values, table.schema.field(column).type),
    )
    with pytest.raises(
        NullValuesError, match=rf"column '{column}' \(.*\) has 1 null value\(s\).*df.na.drop\(subset=\['{column}'\]\)"
    ):
        write_node_data(table.to_batches(), str(tmp_path))
    with pytest.raises(FileNotFoundError, match="is not a folder staged by run_on_dataframe"):
        StagedColumns(str(tmp_path / "data"))  # no manifest: nothing half-written looks staged


def test_null_items_inside_arrays_refused(tmp_path: Path) -> None:
    table = pa.table({"a": pa.array([[1.0, None], [2.0, 3.0]])})
    with pytest.raises(NullValuesError, match=r"column 'a' .* has 1 null item\(s\) inside its arrays"):
        write_node_data(table.to_batches(), str(tmp_path))


def test_gather_reads_only_mapped_files(tmp_path: Path) -> None:
    """The staged parts are memory-mapped (not read into memory); gathers are private copies."""
    path, _ = write_node_data(every_type_table(8).to_batches(), str(tmp_path))
    staged = StagedColumns(path)
    assert isinstance(staged.part("fixed", "items"), np.memmap)
    parts = staged.gather("fixed", [5, 1])
    assert parts["items"].tolist() == [[5, -5], [1, -1]] and not isinstance(parts["items"], np.memmap)
    assert parts["items"].flags.writeable


def test_empty_node_and_missing_folder(tmp_path: Path) -> None:
    writer = ColumnWriter(str(tmp_path / "empty"))
    assert writer.close() == 0 and StagedColumns(str(tmp_path / "empty")).rows == 0
    with pytest.raises(FileNotFoundError, match="is not a folder staged by run_on_dataframe"):
        StagedColumns(str(tmp_path / "nothing"))


def test_unsupported_type_named() -> None:
    with pytest.raises(TypeError, match="unsupported column type map"):
        column_kind(pa.map_(pa.string(), pa.int32()))
