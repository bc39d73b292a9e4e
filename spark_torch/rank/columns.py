"""Gathered column rows as tensors (inside a rank): scalars, arrays, Spark ML vectors, strings, binary.

The rows come from :meth:`spark_torch.shared.column_files.StagedColumns.gather` as numpy parts in
this rank's memory (never views of the memory-mapped file), so tensors share them without a
copy. Floating-point arrays and Spark ML vectors (dense or sparse) become ``float32`` tensors
unless a dtype says otherwise (:func:`column_dtypes`): that is what a ``torch.nn`` module
holds by default, and a float64 batch would fail in its first layer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from spark_torch.shared.column_files import column_kind

__all__ = ["column_kind", "column_dtypes", "to_tensor", "dense_vectors"]

#: kinds a dtype applies to (strings and bytes stay Python objects)
_NUMERIC = ("scalar", "array", "vector")


def column_dtypes(kinds: Mapping[str, str], floats: Mapping[str, bool], dtype: Any) -> dict[str, Any]:
    """The torch dtype each numeric column becomes (None: keep the column's own type).

    ``dtype``: None (floating arrays and vectors -> float32, the rest as stored), one torch
    dtype (every floating-point column, scalars included, and every vector), or a mapping of
    column name -> torch dtype (those columns, any numeric kind; the others as with None).
    ``floats``: whether a column's numbers are floating point. Raises ``ValueError`` naming
    a column that is not there, not numeric, or a value that is not a torch dtype.
    """
    import torch

    def default(name: str) -> Any:
        kind = kinds[name]
        return torch.float32 if kind == "vector" or (kind == "array" and floats[name]) else None

    def check(value: Any, what: str) -> Any:
        if not isinstance(value, torch.dtype):
            raise ValueError(f"{what} must be a torch dtype such as torch.float32, got {value!r}")
        return value

    if dtype is None:
        return {name: default(name) for name in kinds}
    if isinstance(dtype, Mapping):
        unknown = [name for name in dtype if name not in kinds]
        if unknown:
            raise ValueError(f"dtype names columns {unknown} that the batches do not have (they have {list(kinds)})")
        textual = [name for name in dtype if kinds[name] not in _NUMERIC]
        if textual:
            raise ValueError(f"dtype names {textual}, which are strings or bytes, not numbers: leave them out of dtype")
        return {name: check(dtype[name], f"dtype[{name!r}]") if name in dtype else default(name) for name in kinds}
    check(dtype, "dtype")
    return {
        name: dtype if kinds[name] == "vector" or (kinds[name] in _NUMERIC and floats[name]) else None for name in kinds
    }


def dense_vectors(parts: Mapping[str, Any], dtype: Any = None) -> Any:
    """Spark ML vectors (gathered parts, see :class:`~spark_torch.shared.column_files.StagedColumns`) ->
    a dense (rows, width) tensor, vectorised; width is the widest vector of the whole column."""
    import numpy as np
    import torch

    kinds = parts["type"]
    value_offsets, values = parts["value_offsets"], parts["values"]
    n, width = len(kinds), int(parts["width"])
    value_lengths = np.diff(value_offsets)
    dense = kinds == 1
    target = np.float32 if dtype is None or dtype == torch.float32 else np.float64
    if dense.all() and n and (value_lengths == width).all():
        out = values.reshape(n, width).astype(target, copy=False)
    else:
        out = np.zeros((n, width), dtype=target)
        rows = np.repeat(np.arange(n), value_lengths)
        # dense rows: the position inside the row; sparse rows: the stored index
        cols = np.arange(len(values)) - np.repeat(value_offsets[:-1], value_lengths)
        sparse_items = ~np.repeat(dense, value_lengths)
        if sparse_items.any():
            # dense rows store no indices, so the gathered indices are exactly the sparse rows',
            # one for each of their values
            cols[sparse_items] = parts["indices"]
        out[rows, cols] = values
    tensor = torch.from_numpy(out)
    return tensor if dtype is None or tensor.dtype == dtype else tensor.to(dtype)


def _text(parts: Mapping[str, Any], binary: bool) -> list[Any]:
    import pyarrow as pa

    valid = parts["valid"]
    validity = None if valid.all() else pa.array(valid).buffers()[1]
    kind = pa.large_binary() if binary else pa.large_string()
    array = pa.Array.from_buffers(
        kind, len(valid), [validity, pa.py_buffer(parts["offsets"]), pa.py_buffer(parts["items"])]
    )
    return list(array.to_pylist())


def to_tensor(parts: Mapping[str, Any], kind: str, dtype: Any = None) -> Any:
    """One column's gathered rows as a batch value: a tensor (``dtype`` if given), a list of
    1-D tensors (ragged arrays), or a list of ``str`` / ``bytes`` (None for a null)."""
    import numpy as np
    import torch

    def cast(tensor: Any) -> Any:
        return tensor if dtype is None or tensor.dtype == dtype else tensor.to(dtype)

    if kind == "scalar":
        return cast(torch.from_numpy(parts["values"]))
    if kind == "array":
        if "offsets" not in parts:
            return cast(torch.from_numpy(parts["items"]))
        offsets, items = parts["offsets"], parts["items"]
        lengths = np.diff(offsets)
        if len(lengths) and (lengths == lengths[0]).all():
            return cast(torch.from_numpy(items).reshape(len(lengths), int(lengths[0])))
        return [cast(torch.from_numpy(items[a:b])) for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist())]
    if kind == "vector":
        return dense_vectors(parts, dtype)
    return _text(parts, binary=kind == "binary")


def float_columns(columns: Mapping[str, Mapping[str, Any]], names: Sequence[str]) -> dict[str, bool]:
    """Whether each column's numbers are floating point (from the staged folder's manifest)."""
    import numpy as np

    out = {}
    for name in names:
        part = "values" if columns[name]["kind"] in ("scalar", "vector") else "items"
        code = columns[name]["dtypes"][part]
        out[name] = columns[name]["kind"] == "vector" or np.dtype(code).kind == "f"
    return out
