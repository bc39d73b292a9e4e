"""Driver side of ``run_on_dataframe``: check the DataFrame's schema before anything starts.

The node side (staging a node's rows) is :mod:`spark_torch.node.staging`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from spark_torch.errors import ConfigurationError

__all__ = ["DataInput", "check_columns"]


def _kind(data_type: Any) -> str | None:
    from pyspark.sql import types as T

    if isinstance(
        data_type, (T.ByteType, T.ShortType, T.IntegerType, T.LongType, T.FloatType, T.DoubleType, T.BooleanType)
    ):
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


@dataclass(frozen=True)
class DataInput:
    """A DataFrame to spread over the ranks, and which columns (``explicit``: tuples, not dicts);
    ``digest``: with ``reuse_staged``, the digest of its plan
    (:func:`spark_torch.driver.spark.staged_reuse.plan_digest`), else None."""

    df: Any
    columns: tuple[str, ...]
    explicit: bool = False
    digest: str | None = None
