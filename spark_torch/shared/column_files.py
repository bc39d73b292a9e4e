"""A node's DataFrame rows on disk (``run_on_dataframe``): one flat file per column part.

The node runner streams the Arrow record batches of its share into :class:`ColumnWriter`
(:mod:`spark_torch.node.staging`); ranks open the folder with :class:`StagedColumns`
(:mod:`spark_torch.rank.data`) and gather any rows with :meth:`StagedColumns.gather`.

Why not an Arrow IPC file: Spark hands the rows over in ~10k-row record batches, and Arrow's
``take`` on a table of many chunks concatenates every chunk of a list, string or struct
column on each call, so a batch cost grew with the rank's total rows (an epoch, with the
square). Here every column part is one contiguous array of the whole node (written chunk by
chunk), so gathering a batch reads only that batch's rows: its cost does not depend on how many
rows the node holds. A rank reads a window of its rows at a time (:meth:`StagedColumns.read`,
``pread``), never its whole share; :meth:`StagedColumns.part` maps a part (tests, readers).

Layout of the folder: ``columns.json`` (rows and, per column, its kind, the parts' dtypes and
facts found while writing) and ``<column index>.<part>`` raw little-endian arrays:

=========  ===========================================================================
kind       parts
=========  ===========================================================================
scalar     ``values`` (one per row)
array      ``ends`` (int64, end offset of each row's items), ``items``
vector     ``type`` (int8: 0 sparse, 1 dense), ``size`` (int32), ``index_ends``,
           ``indices`` (int32), ``value_ends``, ``values`` (float64)
string,    ``ends``, ``items`` (uint8, the UTF-8 or raw bytes), ``valid`` (bool; a
binary     null string or bytes value arrives as None)
=========  ===========================================================================

Null numbers cannot become tensors: the writer refuses them with :class:`NullValuesError`,
naming the column, while the node stages its rows, before any rank starts.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from spark_torch.shared.column_reads import PartReader
from spark_torch.shared.workdir_files import open_private

__all__ = ["ColumnWriter", "StagedColumns", "NullValuesError", "MANIFEST", "column_kind"]

#: the folder's description, written last (a folder without it was not staged completely)
MANIFEST = "columns.json"
#: Arrow struct layout of Spark ML's VectorUDT
_VECTOR_FIELDS = {"type", "size", "indices", "values"}
_PARTS = {
    "scalar": ("values",),
    "array": ("ends", "items"),
    "vector": ("type", "size", "index_ends", "indices", "value_ends", "values"),
    "string": ("ends", "items", "valid"),
    "binary": ("ends", "items", "valid"),
}


class NullValuesError(ValueError):
    """A column the ranks would turn into tensors holds nulls (the message names it)."""


def column_kind(arrow_type: Any) -> str:
    """How a column converts: 'scalar', 'array', 'vector', 'string', 'binary'; else TypeError."""
    import pyarrow.types as t

    def numeric(kind: Any) -> bool:
        return bool(t.is_integer(kind) or t.is_floating(kind) or t.is_boolean(kind))

    if numeric(arrow_type):
        return "scalar"
    if (t.is_list(arrow_type) or t.is_large_list(arrow_type) or t.is_fixed_size_list(arrow_type)) and numeric(
        arrow_type.value_type
    ):
        return "array"
    if t.is_struct(arrow_type) and {arrow_type.field(i).name for i in range(arrow_type.num_fields)} == _VECTOR_FIELDS:
        return "vector"
    if t.is_string(arrow_type) or t.is_large_string(arrow_type):
        return "string"
    if t.is_binary(arrow_type) or t.is_large_binary(arrow_type):
        return "binary"
    raise TypeError(f"unsupported column type {arrow_type}")


def _numpy(array: Any) -> Any:
    """An Arrow array without nulls as numpy (booleans as one byte each)."""
    return array.to_numpy(zero_copy_only=False)


def _list_parts(array: Any) -> tuple[Any, Any]:
    """(lengths, flat items) of a list / large list / fixed-size list array (nulls: length 0)."""
    import pyarrow.compute as pc

    lengths = pc.list_value_length(array).fill_null(0).to_numpy(zero_copy_only=False)
    return lengths, array.flatten()


def _bytes_parts(array: Any) -> tuple[Any, Any, Any]:
    """(lengths, bytes, valid) of a string or binary array, without a copy per value."""
    import numpy as np
    import pyarrow.compute as pc
    import pyarrow.types as t

    lengths = pc.binary_length(array).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    offsets_buffer, data = array.buffers()[1], array.buffers()[2]
    wide = t.is_large_string(array.type) or t.is_large_binary(array.type)
    offsets = np.frombuffer(offsets_buffer, dtype=np.int64 if wide else np.int32)[
        array.offset : array.offset + len(array) + 1
    ]
    start, stop = (int(offsets[0]), int(offsets[-1])) if len(array) else (0, 0)
    items = np.frombuffer(data, dtype=np.uint8)[start:stop] if data is not None else np.zeros(0, np.uint8)
    valid = array.is_valid().to_numpy(zero_copy_only=False)
    return lengths, items, valid


def _dtypes(kind: str, arrow_type: Any) -> dict[str, str]:
    """The numpy dtype of each part of a column of ``kind`` (known before any row arrives)."""
    import numpy as np

    if kind == "scalar":
        return {"values": np.dtype(arrow_type.to_pandas_dtype()).str}
    ends = np.dtype(np.int64).str
    if kind == "array":
        return {"ends": ends, "items": np.dtype(arrow_type.value_type.to_pandas_dtype()).str}
    if kind == "vector":
        return {
            "type": np.dtype(np.int8).str,
            "size": np.dtype(np.int32).str,
            "index_ends": ends,
            "indices": np.dtype(np.int32).str,
            "value_ends": ends,
            "values": np.dtype(np.float64).str,
        }
    return {"ends": ends, "items": np.dtype(np.uint8).str, "valid": np.dtype(np.bool_).str}


class ColumnWriter:
    """Streams record batches into a staged folder (see the module docstring); :meth:`close`
    writes the manifest. Raises :class:`NullValuesError` for nulls in a numeric column and
    ``TypeError`` for a column type no rank could convert."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.rows = 0
        self._columns: list[dict[str, Any]] = []
        self._started = False
        self._ends: dict[tuple[int, str], int] = {}
        os.makedirs(directory, mode=0o700, exist_ok=True)

    def _path(self, index: int, part: str) -> str:
        return os.path.join(self.directory, f"{index}.{part}")

    def _start(self, schema: Any) -> None:
        self._started = True
        for index, field in enumerate(schema):
            kind = column_kind(field.type)
            self._columns.append(
                {
                    "name": field.name,
                    "kind": kind,
                    "arrow_type": str(field.type),
                    "dtypes": _dtypes(kind, field.type),
                    "width": None,
                    "uniform": True,
                }
            )
            for part in _PARTS[kind]:
                open_private(self._path(index, part), "wb").close()
                if part.endswith("ends"):
                    self._ends[(index, part)] = 0

    def _put(self, index: int, part: str, values: Any) -> None:
        import numpy as np

        values = np.ascontiguousarray(values, dtype=np.dtype(self._columns[index]["dtypes"][part]))
        # opened per write, not held: a DataFrame of a thousand columns must not use a thousand
        # descriptors here (a batch is thousands of rows, so an open per part and batch is cheap)
        with open(self._path(index, part), "ab") as fh:
            fh.write(memoryview(values).cast("B"))

    def _put_ends(self, index: int, part: str, lengths: Any) -> None:
        import numpy as np

        ends = self._ends[(index, part)] + np.cumsum(lengths, dtype=np.int64)
        if len(ends):
            self._ends[(index, part)] = int(ends[-1])
        self._put(index, part, ends)

    def _null(self, index: int, count: int, what: str = "null value(s)") -> NullValuesError:
        column = self._columns[index]
        return NullValuesError(
            f"column {column['name']!r} ({column['arrow_type']}) has {count} {what} in this node's rows; "
            f"tensors cannot hold nulls: fill or drop them first, e.g. df.na.drop(subset=[{column['name']!r}]) "
            f"or df.na.fill(0, subset=[{column['name']!r}])"
        )

    def write(self, batch: Any) -> None:
        """Append one Arrow record batch (the first one fixes the columns)."""
        import numpy as np

        if not self._started:
            self._start(batch.schema)
        if not batch.num_rows:
            return
        for index, column in enumerate(self._columns):
            array = batch.column(index)
            kind = column["kind"]
            if kind in ("scalar", "array", "vector") and array.null_count:
                raise self._null(index, array.null_count)
            if kind == "scalar":
                self._put(index, "values", _numpy(array))
            elif kind == "array":
                lengths, items = _list_parts(array)
                if items.null_count:
                    raise self._null(index, items.null_count, "null item(s) inside its arrays")
                self._note_width(column, lengths)
                self._put_ends(index, "ends", lengths)
                self._put(index, "items", _numpy(items))
            elif kind == "vector":
                self._write_vectors(index, column, array)
            else:
                lengths, items, valid = _bytes_parts(array)
                self._put_ends(index, "ends", lengths)
                self._put(index, "items", items)
                self._put(index, "valid", np.asarray(valid, dtype=np.bool_))
        self.rows += batch.num_rows

    def _write_vectors(self, index: int, column: dict[str, Any], array: Any) -> None:

        kinds = _numpy(array.field("type"))
        sizes = array.field("size").fill_null(0).to_numpy(zero_copy_only=False)
        index_lengths, indices = _list_parts(array.field("indices"))
        value_lengths, values = _list_parts(array.field("values"))
        dense = kinds == 1
        width = int(max(value_lengths[dense].max(initial=0), sizes[~dense].max(initial=0)))
        column["width"] = max(column["width"] or 0, width)
        self._put(index, "type", kinds)
        self._put(index, "size", sizes)
        self._put_ends(index, "index_ends", index_lengths)
        self._put(index, "indices", _numpy(indices))
        self._put_ends(index, "value_ends", value_lengths)
        self._put(index, "values", _numpy(values))

    @staticmethod
    def _note_width(column: dict[str, Any], lengths: Any) -> None:
        if not len(lengths):
            return
        first = int(lengths[0]) if column["width"] is None else column["width"]
        column["width"] = first
        column["uniform"] = bool(column["uniform"] and (lengths == first).all())

    def close(self) -> int:
        """Write the manifest (the folder is complete); returns the rows written."""
        manifest = {"rows": self.rows, "columns": self._columns}
        temp = os.path.join(self.directory, MANIFEST + ".tmp")
        with open_private(temp, "w") as fh:
            json.dump(manifest, fh)
        os.replace(temp, os.path.join(self.directory, MANIFEST))
        return self.rows


class StagedColumns:
    """A staged folder, memory-mapped: its columns' kinds and any rows of them."""

    def __init__(self, directory: str) -> None:
        path = os.path.join(directory, MANIFEST)
        try:
            with open(path) as fh:
                manifest = json.load(fh)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"{path} does not exist: {directory} is not a folder staged by run_on_dataframe"
            ) from None
        self.directory = directory
        self.rows: int = int(manifest["rows"])
        self.columns: dict[str, dict[str, Any]] = {}
        self._index: dict[str, int] = {}
        for index, column in enumerate(manifest["columns"]):
            self.columns[column["name"]] = column
            self._index[column["name"]] = index
        self._maps: dict[tuple[str, str], Any] = {}

    @property
    def names(self) -> list[str]:
        return list(self.columns)

    def part(self, name: str, part: str) -> Any:
        """One part of a column as a read-only memory-mapped numpy array (empty: an empty array)."""
        import numpy as np

        key = (name, part)
        if key not in self._maps:
            dtype = np.dtype(self.columns[name]["dtypes"][part])
            path = os.path.join(self.directory, f"{self._index[name]}.{part}")
            size = os.path.getsize(path)
            self._maps[key] = np.memmap(path, dtype=dtype, mode="r") if size else np.zeros(0, dtype=dtype)
        return self._maps[key]

    def row_bytes(self, names: Sequence[str]) -> float:
        """The bytes one row of the named columns takes in the files, on average."""
        total = sum(
            os.path.getsize(os.path.join(self.directory, f"{self._index[name]}.{part}"))
            for name in names
            for part in _PARTS[self.columns[name]["kind"]]
        )
        return total / max(self.rows, 1)

    def read(self, names: Sequence[str], ranges: Sequence[tuple[int, int]]) -> StagedColumns:
        """The rows of ``ranges`` (``(start, stop)`` file positions), in that order, of the named
        columns, read into this process's memory (``pread``, never mapped: the files' pages do not
        count in its resident memory) as a :class:`StagedColumns` of their own, row ``i`` being
        the ``i``-th row of the ranges; :meth:`gather` works on it as on the files."""
        rows = StagedColumns.__new__(StagedColumns)
        rows.directory, rows.columns, rows._index = self.directory, self.columns, self._index
        rows.rows = sum(stop - start for start, stop in ranges)
        rows._maps = {}
        for name in names:
            column = self.columns[name]
            kind = column["kind"]
            with PartReader(self.directory, self._index[name], column["dtypes"]) as files:
                if kind == "scalar":
                    rows._maps[(name, "values")] = files.ranges("values", ranges)
                elif kind == "array" and column["uniform"] and column["width"] is not None:
                    width = int(column["width"])
                    rows._maps[(name, "items")] = files.ranges("items", [(a * width, b * width) for a, b in ranges])
                elif kind == "array":
                    rows._maps[(name, "ends")], rows._maps[(name, "items")] = files.nested("ends", "items", ranges)
                elif kind == "vector":
                    for part in ("type", "size"):
                        rows._maps[(name, part)] = files.ranges(part, ranges)
                    for ends, items in (("index_ends", "indices"), ("value_ends", "values")):
                        rows._maps[(name, ends)], rows._maps[(name, items)] = files.nested(ends, items, ranges)
                else:
                    rows._maps[(name, "ends")], rows._maps[(name, "items")] = files.nested("ends", "items", ranges)
                    rows._maps[(name, "valid")] = files.ranges("valid", ranges)
        return rows

    def _ranges(self, name: str, part: str, rows: Any) -> tuple[Any, Any]:
        """(starts, lengths) of ``rows``' items, from the ``part`` ends."""
        import numpy as np

        ends = self.part(name, part)
        stops = np.asarray(ends[rows], dtype=np.int64)
        starts = np.where(rows > 0, np.asarray(ends[np.maximum(rows - 1, 0)], dtype=np.int64), 0)
        return starts, stops - starts

    def _items(self, name: str, part: str, starts: Any, lengths: Any) -> tuple[Any, Any]:
        """(offsets into the result, items) of the gathered rows, in the rows' order."""
        import numpy as np

        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        flat = np.repeat(starts - offsets[:-1], lengths) + np.arange(offsets[-1], dtype=np.int64)
        return offsets, np.asarray(self.part(name, part)[flat])

    def gather(self, name: str, rows: Sequence[int] | Any) -> dict[str, Any]:
        """The given rows (file positions, any order) of one column as in-memory numpy parts:
        ``values`` (scalar); ``offsets`` + ``items`` or, for arrays of one width, ``items`` of
        shape (rows, width) (array); ``offsets`` + ``items`` + ``valid`` (string, binary);
        ``type``, ``size``, ``index_offsets``, ``indices``, ``value_offsets``, ``values`` (vector)."""
        import numpy as np

        rows = np.asarray(rows, dtype=np.int64)
        column = self.columns[name]
        kind = column["kind"]
        if kind == "scalar":
            return {"values": np.asarray(self.part(name, "values")[rows])}
        if kind == "array":
            if column["uniform"] and column["width"] is not None:
                items = self.part(name, "items")
                return {"items": np.asarray(items.reshape(-1, column["width"])[rows])}
            offsets, items = self._items(name, "items", *self._ranges(name, "ends", rows))
            return {"offsets": offsets, "items": items}
        if kind == "vector":
            index_offsets, indices = self._items(name, "indices", *self._ranges(name, "index_ends", rows))
            value_offsets, values = self._items(name, "values", *self._ranges(name, "value_ends", rows))
            return {
                "type": np.asarray(self.part(name, "type")[rows]),
                "size": np.asarray(self.part(name, "size")[rows]),
                "index_offsets": index_offsets,
                "indices": indices,
                "value_offsets": value_offsets,
                "values": values,
                "width": column["width"] or 0,
            }
        offsets, items = self._items(name, "items", *self._ranges(name, "ends", rows))
        return {"offsets": offsets, "items": items, "valid": np.asarray(self.part(name, "valid")[rows])}
