"""run_on_dataframe: a DataFrame's rows reach the ranks as tensors, each row exactly once."""

from __future__ import annotations

import os
from typing import Any

import pytest

from spark_torch import ConfigurationError, Distributor


def make_df(spark: Any, rows: int = 103, partitions: int = 10) -> Any:
    from pyspark.ml.linalg import SparseVector, Vectors

    data = []
    for i in range(rows):
        vec = Vectors.dense([float(i), 1.0, 2.0]) if i % 2 else SparseVector(3, {0: float(i)})
        data.append((i, float(i) / 10, i % 3 == 0, [float(i)] * 4, vec, f"row{i}", bytes([i % 256]), float(i % 2)))
    schema = "id long, x double, flag boolean, arr array<float>, vec vector, name string, blob binary, label double"
    from pyspark.ml.linalg import VectorUDT
    from pyspark.sql.types import (
        ArrayType,
        BinaryType,
        BooleanType,
        DoubleType,
        FloatType,
        LongType,
        StringType,
        StructField,
        StructType,
    )

    struct = StructType(
        [
            StructField("id", LongType()),
            StructField("x", DoubleType()),
            StructField("flag", BooleanType()),
            StructField("arr", ArrayType(FloatType())),
            StructField("vec", VectorUDT()),
            StructField("name", StringType()),
            StructField("blob", BinaryType()),
            StructField("label", DoubleType()),
        ]
    )
    del schema
    return spark.createDataFrame(data, struct).repartition(partitions)


def train_on_rows(epochs: int, seed: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from spark_torch.data import rank_loader

    dist.init_process_group("gloo", init_method="env://")
    model = torch.nn.Linear(3 + 4 + 1, 1)  # float32, as vectors and float arrays arrive by default
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = rank_loader(batch_size=8, shuffle=True, seed=seed, dtype={"x": torch.float32, "label": torch.float32})
    orders: list[list[int]] = []
    checks: dict[str, Any] = {}
    for _ in range(epochs):
        seen: list[int] = []
        for batch in loader:
            seen += batch["id"].tolist()
            feats = torch.cat([batch["vec"], batch["arr"], batch["x"].unsqueeze(1)], dim=1)
            loss = torch.nn.functional.mse_loss(model(feats).squeeze(1), batch["label"])
            opt.zero_grad()
            loss.backward()
            opt.step()
            checks = {
                "vec_shape": list(batch["vec"].shape),
                "arr_shape": list(batch["arr"].shape),
                "flag_dtype": str(batch["flag"].dtype),
                "name": batch["name"][0][:3],
                "blob_type": type(batch["blob"][0]).__name__,
                "float_dtypes": sorted({str(batch[c].dtype) for c in ("vec", "arr", "x", "label")}),
            }
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, seen)
        orders.append([i for part in gathered for i in part])
    dist.destroy_process_group()
    return {"orders": orders, "checks": checks}


def _check(out: dict[str, Any], rows: int) -> None:
    for order in out["orders"]:
        # every row at least once per epoch; ranks with fewer rows repeat a few of theirs so
        # that every rank has the same number of batches (DDP needs that)
        assert set(order) == set(range(rows)) and len(order) - rows < 12
    assert out["orders"][0] != out["orders"][1]  # reshuffled per epoch
    assert out["checks"]["vec_shape"][1] == 3 and out["checks"]["arr_shape"][1] == 4
    assert out["checks"]["flag_dtype"] == "torch.bool" and out["checks"]["name"] == "row"
    assert out["checks"]["blob_type"] == "bytes" and out["checks"]["float_dtypes"] == ["torch.float32"]


def test_distributed_local2(spark_session: Any, no_leftovers: None) -> None:
    df = make_df(spark_session)
    dist = Distributor(num_processes=2, local_mode=False, spark=spark_session)
    first = dist.run_on_dataframe(train_on_rows, df, 2, seed=7)
    _check(first, 103)
    again = dist.run_on_dataframe(train_on_rows, df, 2, seed=7)
    assert again["orders"] == first["orders"]  # reproducible by seed (and deterministic sharding)


def test_local_mode(spark_session: Any, no_leftovers: None) -> None:
    out = Distributor(num_processes=2, spark=spark_session).run_on_dataframe(
        train_on_rows, make_df(spark_session), 2, seed=1
    )
    _check(out, 103)


@pytest.mark.slow
def test_distributed_cluster(cluster_spark: Any, no_leftovers: None) -> None:
    _check(
        Distributor(num_processes=2, local_mode=False, spark=cluster_spark).run_on_dataframe(
            train_on_rows, make_df(cluster_spark), 2, seed=3
        ),
        103,
    )


def tuples_and_workers() -> list[Any]:
    from spark_torch.data import rank_loader

    loader = rank_loader(batch_size=4, num_workers=2)
    out = []
    for ids, x in loader:
        out += [(int(i), float(v)) for i, v in zip(ids, x)]
    return out


def test_columns_as_tuples_and_workers(spark_session: Any, no_leftovers: None) -> None:
    df = make_df(spark_session, rows=40, partitions=3)
    out = Distributor(num_processes=1, spark=spark_session).run_on_dataframe(
        tuples_and_workers, df, columns=["id", "x"]
    )
    assert sorted(i for i, _ in out) == list(range(40)) and all(abs(x - i / 10) < 1e-9 for i, x in out)


def test_empty_dataframe_fails_before_training(spark_session: Any, no_leftovers: None) -> None:
    df = make_df(spark_session).limit(0)
    with pytest.raises(ConfigurationError, match="the DataFrame is empty"):
        Distributor(num_processes=2, local_mode=False, spark=spark_session).run_on_dataframe(train_on_rows, df, 1, 0)
    few = make_df(spark_session, rows=1, partitions=1)
    with pytest.raises(ConfigurationError, match="every rank needs at least one row"):
        Distributor(num_processes=2, spark=spark_session).run_on_dataframe(train_on_rows, few, 1, 0)


def test_unsupported_type_named(spark_session: Any) -> None:
    df = spark_session.sql("select 1 as id, map('a', 1) as m, current_date() as d")
    with pytest.raises(ConfigurationError, match=r"column 'm' has type map<string,int>"):
        Distributor(num_processes=1, spark=spark_session).run_on_dataframe(train_on_rows, df, 1, 0)
    with pytest.raises(ConfigurationError, match=r"columns \['nope'\] are not in the DataFrame"):
        Distributor(num_processes=1, spark=spark_session).run_on_dataframe(train_on_rows, df, 1, 0, columns=["nope"])


def _never_starts(marker: str) -> None:
    open(marker, "w").close()


@pytest.mark.parametrize("local_mode", [True, False])
def test_null_numbers_named_before_any_rank_starts(
    spark_session: Any, no_leftovers: None, tmp_path: Any, local_mode: bool
) -> None:
    """A null in a numeric column fails while the node stages its rows, naming the column."""
    df = make_df(spark_session, rows=30, partitions=3).selectExpr("id", "IF(id = 17, NULL, x) AS x", "label")
    marker = str(tmp_path / "started")
    with pytest.raises(
        ConfigurationError, match=r"column 'x' \(double\) has 1 null value\(s\).*df\.na\.drop\(subset=\['x'\]\)"
    ):
        Distributor(num_processes=2, local_mode=local_mode, spark=spark_session).run_on_dataframe(
            _never_starts, df, marker
        )
    assert not os.path.exists(marker)
