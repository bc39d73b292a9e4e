"""Arrow columns as tensors (inside a rank): scalars, arrays, Spark ML vectors, strings, binary.

Numeric columns become tensors without copies where Arrow allows; Spark ML vectors (dense or
sparse, Arrow structs of ``type, size, indices, values``) become dense float64 matrices.
"""

from __future__ import annotations

from typing import Any

__all__ = ["column_kind", "to_tensor"]

#: Arrow struct layout of Spark ML's VectorUDT
_VECTOR_FIELDS = {"type", "size", "indices", "values"}


def column_kind(arrow_type: Any) -> str:
    """How a column converts: 'scalar', 'array', 'vector', 'string', 'binary'; else TypeError."""
    import pyarrow.types as t

    if t.is_integer(arrow_type) or t.is_floating(arrow_type) or t.is_boolean(arrow_type):
        return "scalar"
    if (t.is_list(arrow_type) or t.is_large_list(arrow_type) or t.is_fixed_size_list(arrow_type)) and (
        t.is_integer(arrow_type.value_type) or t.is_floating(arrow_type.value_type) or t.is_boolean(arrow_type.value_type)
    ):
        return "array"
    if t.is_struct(arrow_type) and {arrow_type.field(i).name for i in range(arrow_type.num_fields)} == _VECTOR_FIELDS:
        return "vector"
    if t.is_string(arrow_type) or t.is_large_string(arrow_type):
        return "string"
    if t.is_binary(arrow_type) or t.is_large_binary(arrow_type):
        return "binary"
    raise TypeError(f"unsupported column type {arrow_type}")


def _vectors_to_dense(column: Any) -> Any:
    """Spark ML vectors (struct<type, size, indices, values>) -> a dense float64 matrix, vectorised."""
    import numpy as np
    import pyarrow as pa
    import torch

    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    n = len(column)
    kinds = column.field("type").to_numpy(zero_copy_only=False)
    values = column.field("values")
    value_offsets = values.offsets.to_numpy()
    value_flat = values.flatten().to_numpy(zero_copy_only=False)
    value_lengths = np.diff(value_offsets)
    sizes = column.field("size").fill_null(0).to_numpy(zero_copy_only=False)
    dense = kinds == 1
    width = int(max(value_lengths[dense].max(initial=0), sizes[~dense].max(initial=0)))
    if dense.all() and n and (value_lengths == width).all():
        return torch.from_numpy(np.ascontiguousarray(value_flat)).reshape(n, width)
    out = np.zeros((n, width), dtype=np.float64)
    rows = np.repeat(np.arange(n), value_lengths)
    dense_items = np.repeat(dense, value_lengths)
    # dense rows: position inside the row; sparse rows: the stored index
    positions = np.arange(len(value_flat)) - np.repeat(value_offsets[:-1], value_lengths)
    indices = column.field("indices")
    index_flat = indices.flatten().to_numpy(zero_copy_only=False) if indices.null_count < n else np.array([], dtype=np.int64)
    cols = positions.copy()
    if len(index_flat):
        # dense rows have null indices, so the flattened indices are exactly the sparse rows'
        # and line up one-to-one with their values
        cols[~dense_items] = index_flat
    out[rows, cols] = value_flat
    return torch.from_numpy(out)


def to_tensor(column: Any, kind: str) -> Any:
    # The arrays come from Arrow buffers that ``take`` just produced (private heap memory, not
    # the memory-mapped file), so sharing them with torch without a copy is safe; torch warns
    # about every read-only numpy array, which is noise here.
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return _to_tensor_unchecked(column, kind)


def _to_tensor_unchecked(column: Any, kind: str) -> Any:
    import numpy as np
    import torch

    if kind == "scalar":
        if column.null_count:
            raise ValueError(f"column has {column.null_count} null value(s); fill or drop them first")
        array = column.to_numpy(zero_copy_only=False)
        return torch.from_numpy(np.ascontiguousarray(array))
    if kind == "array":
        import pyarrow as pa

        if isinstance(column, pa.ChunkedArray):
            column = column.combine_chunks()
        offsets = column.offsets.to_numpy() if hasattr(column, "offsets") else None
        values = column.flatten().to_numpy(zero_copy_only=False)
        if offsets is None:  # fixed size list
            width = column.type.list_size
            return torch.from_numpy(np.ascontiguousarray(values)).reshape(len(column), width)
        lengths = np.diff(offsets)
        if len(lengths) and (lengths == lengths[0]).all():
            return torch.from_numpy(np.ascontiguousarray(values)).reshape(len(column), int(lengths[0]))
        return [torch.from_numpy(np.ascontiguousarray(values[a:b])) for a, b in zip(offsets[:-1], offsets[1:])]
    if kind == "vector":
        return _vectors_to_dense(column)  # float64 matrix
    return column.to_pylist()  # string / binary
