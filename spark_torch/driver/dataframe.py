"""Driver/executor plumbing of ``run_on_dataframe``: check the schema, stage a node's rows."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from spark_torch.errors import ConfigurationError

__all__ = ["DataInput", "check_columns", "write_node_data", "data_env", "check_shards", "DATA_FILE_NAME"]

DATA_FILE_NAME = "data.arrow"


def _kind(data_type: Any) -> str | None:
    from pyspark.sql import types as T

    if isinstance(data_type, (T.ByteType, T.ShortType, T.IntegerType, T.LongType, T.FloatType, T.DoubleType, T.BooleanType)):
        return "scalar"
    if isinstance(data_type, T.ArrayType) and _kind(data_type.elementType) == "scalar":
        return "array"
    if isinstance(data_type, T.UserDefinedType) and type(data_type).__name__ == "VectorUDT":
        return "vector"
    if isinstance(data_type, T.StringType):
        return "string"
    if isinstance(data_type, T.BinaryType):
        return "binary"
    return None


def check_columns(schema: Any, columns: Sequence[str] | None) -> list[str]:
    """The columns to ship, after checking each exists and has a supported type."""
    names = list(schema.fieldNames())
    chosen = list(columns) if columns is not None else names
    if not chosen:
        raise ConfigurationError("the DataFrame has no columns to train on")
    unknown = [c for c in chosen if c not in names]
    if unknown:
        raise ConfigurationError(f"columns {unknown} are not in the DataFrame (it has {names})")
    for name in chosen:
        data_type = schema[name].dataType
        if _kind(data_type) is None:
            raise ConfigurationError(
                f"column {name!r} has type {data_type.simpleString()}, which spark_torch cannot turn "
                "into tensors; supported: integer/float/bool scalars, arrays of numbers, Spark ML "
                "vectors, strings and binary. Cast or drop it (e.g. df.withColumn(name, col(name).cast('double')))"
            )
    return chosen


def write_node_data(batches: Iterable[Any], directory: str) -> tuple[str, int]:
    """Stream Arrow record batches into ``directory/data.arrow``; returns (path, rows)."""
    import pyarrow as pa

    path = os.path.join(directory, DATA_FILE_NAME)
    rows = 0
    writer = None
    try:
        for batch in batches:
            if writer is None:
                writer = pa.ipc.new_file(path, batch.schema)
            if batch.num_rows:
                writer.write_batch(batch)
                rows += batch.num_rows
    finally:
        if writer is not None:
            writer.close()
    if writer is None:  # no batch at all: an empty file the ranks can still open
        return path, 0
    return path, rows


@dataclass(frozen=True)
class DataInput:
    """A DataFrame to spread over the ranks, and which columns (``explicit``: tuples, not dicts)."""

    df: Any
    columns: tuple[str, ...]
    explicit: bool = False


def data_env(path: str, columns: Sequence[str], explicit: bool, *, rows_per_node: Sequence[int] = ()) -> dict[str, str]:
    """The variables that tell :mod:`spark_torch.rank.data` where this node's rows are.

    ``rows_per_node``: every node's row count, in node order (known after the rendezvous).
    """
    from spark_torch.rank.data import DATA_COLUMNS_ENV, DATA_FILE_ENV, DATA_ROWS_ENV

    env = {DATA_FILE_ENV: path}
    if rows_per_node:
        env[DATA_ROWS_ENV] = json.dumps([int(r) for r in rows_per_node])
    if explicit:
        env[DATA_COLUMNS_ENV] = json.dumps(list(columns))
    return env


def check_shards(rows_per_node: Sequence[int], procs_per_node: int) -> str | None:
    """Why some rank would get no rows (a message), or None when every rank has data."""
    total = sum(rows_per_node)
    world = procs_per_node * len(rows_per_node)
    if total == 0:
        return "the DataFrame is empty; there is nothing to train on"
    for node, rows in enumerate(rows_per_node):
        if rows < procs_per_node:
            return (
                f"the DataFrame has {total} row(s) for {world} ranks and node {node} got {rows} for its "
                f"{procs_per_node} rank(s): every rank needs at least one row. Use fewer processes or more data"
            )
    return None
