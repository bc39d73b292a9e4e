"""A node's share of the DataFrame for ``run_on_dataframe``: staged to a file, checked, described.

The node's Arrow record batches (from the barrier stage's input, or collected by the driver in
local mode) are written as column files (:mod:`spark_torch.shared.column_files`) to the node's scratch directory
(:meth:`~spark_torch.shared.workdir_files.WorkdirFiles.data`); after the rendezvous
every node knows every node's row count, checks that each rank gets rows, and tells its ranks
where the file is (:mod:`spark_torch.rank.data` reads it).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

from spark_torch.base import envnames
from spark_torch.shared.column_files import ColumnWriter
from spark_torch.shared.workdir_files import WorkdirFiles

__all__ = ["write_node_data", "data_env", "check_shards"]


def write_node_data(batches: Iterable[Any], directory: str) -> tuple[str, int]:
    """Stream Arrow record batches into the data folder of the scratch ``directory``; returns
    (path, rows). Raises :class:`~spark_torch.shared.column_files.NullValuesError` naming a numeric
    column that holds nulls (before any rank starts)."""
    path = WorkdirFiles(directory).data()
    writer = ColumnWriter(path)
    for batch in batches:
        writer.write(batch)
    return path, writer.close()  # no manifest after an error: the folder is not staged


def data_env(path: str, columns: Sequence[str], explicit: bool, *, rows_per_node: Sequence[int] = ()) -> dict[str, str]:
    """The variables that tell :mod:`spark_torch.rank.data` where this node's rows are.

    ``rows_per_node``: every node's row count, in node order (known after the rendezvous).
    """
    env = {envnames.DATA_FILE: path}
    if rows_per_node:
        env[envnames.DATA_ROWS] = json.dumps([int(r) for r in rows_per_node])
    if explicit:
        env[envnames.DATA_COLUMNS] = json.dumps(list(columns))
    return env


def check_shards(rows_per_node: Sequence[int], procs_per_node: int, groups: int = 1) -> str | None:
    """Why some rank would get no rows (a message), or None when every rank has data. With
    ``groups`` replica groups each node's rows are split over every group's ranks on it."""
    total = sum(rows_per_node)
    world = procs_per_node * len(rows_per_node)
    if total == 0:
        return "the DataFrame is empty; there is nothing to train on"
    slots = procs_per_node * groups
    for node, rows in enumerate(rows_per_node):
        if rows < slots:
            if groups > 1:
                return (
                    f"the DataFrame has {total} row(s) for {groups} replica groups of {world} rank(s), and node "
                    f"{node} got {rows} for its {procs_per_node} rank(s) of each group: every rank of every group "
                    "needs at least one row of its own. Use fewer replica groups or processes, or more data"
                )
            return (
                f"the DataFrame has {total} row(s) for {world} ranks and node {node} got {rows} for its "
                f"{procs_per_node} rank(s): every rank needs at least one row. Use fewer processes or more data"
            )
    return None
