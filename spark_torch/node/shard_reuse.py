"""A node's rows for one attempt of ``run_on_dataframe``: staged now, or a shard kept by an earlier run.

:func:`node_shard` runs before the rendezvous: without ``reuse_staged`` it stages the node's input
into the run's scratch directory (:func:`~spark_torch.node.staging.write_node_data`); with it, it
either stages into the kept-shards folder of the Spark local directory
(:mod:`spark_torch.shared.staged_shards`: temporary name, then renamed) or, on a reuse attempt,
offers the kept shards this executor holds (each locked). After the rendezvous every node knows
every node's offer and computes the same assignment (:func:`assign_shards`): each shard to exactly
one node, a node's own shard first. When the offers do not cover every node, no node runs and each
says so (``ShardSource.MISSED``); the driver then stages from the DataFrame again.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from spark_torch.node.staging import write_node_data
from spark_torch.node.workdir import scratch_root
from spark_torch.shared.column_files import ColumnWriter
from spark_torch.shared.spec import RunSpec
from spark_torch.shared.staged_shards import (
    HeldShard,
    ShardSource,
    ShardUse,
    held_shards,
    publish,
    start_shard,
    sweep,
    usable_cache,
)

__all__ = ["NodeShard", "Placement", "node_shard", "assign_shards"]


def assign_shards(offers: Sequence[Sequence[int]], shards: int) -> list[int] | None:
    """Which shard each node takes (index: node), every shard ``0..shards-1`` exactly once, each
    node only one it offers; None when no such assignment exists. Deterministic (every node
    computes the same from the same offers): node order, a node's own shard first."""
    if len(offers) != shards:
        return None
    owner: dict[int, int] = {}

    def take(node: int, seen: set[int]) -> bool:
        for shard in sorted(set(offers[node]), key=lambda s: (s != node, s)):
            if shard in seen or not 0 <= shard < shards:
                continue
            seen.add(shard)
            if shard not in owner or take(owner[shard], seen):
                owner[shard] = node
                return True
        return False

    for node in range(shards):
        if not take(node, set()):
            return None
    assigned = [0] * shards
    for shard, node in owner.items():
        assigned[node] = shard
    return assigned


@dataclass(frozen=True)
class Placement:
    """This node's rows after the rendezvous: the staged folder, every node's row count in node
    order, and what the node tells the driver."""

    path: str
    rows_per_node: list[int]
    use: ShardUse


@dataclass
class NodeShard:
    """This node's rows before the rendezvous (see the module docstring); :meth:`close` releases
    the kept shards it holds and removes a copy only this attempt uses."""

    node_rank: int
    #: staged now (None: a reuse attempt, whose shard is known after the rendezvous)
    path: str | None = None
    rows: int = 0
    source: ShardSource | None = None
    #: a reuse attempt: the kept shards offered, each locked
    held: list[HeldShard] = field(default_factory=list)
    #: the folder of kept shards of a staging attempt (its lock: ``lock``), removed by close()
    #: when it could not be published
    temp: str | None = None
    lock: int | None = None

    def hello(self) -> dict[str, Any]:
        """What this node says at the rendezvous about its rows."""
        return {"rows": self.rows, "offers": [[h.shard, h.rows] for h in self.held]}

    def place(self, peers: list[dict[str, Any]]) -> Placement | None:
        """This node's rows from every node's hello; None when kept shards do not cover every
        node (a reuse attempt that missed)."""
        if self.path is not None:
            use = ShardUse(shard=self.node_rank, rows=self.rows, source=self.source or ShardSource.PRIVATE)
            return Placement(self.path, [int(p["rows"]) for p in peers], use)
        offers = [{int(shard): int(rows) for shard, rows in p.get("offers") or ()} for p in peers]
        assigned = assign_shards([list(o) for o in offers], len(peers))
        if assigned is None:
            return None
        mine = next(h for h in self.held if h.shard == assigned[self.node_rank])
        for held in self.held:
            if held is not mine:
                held.release()  # another node trains on it
        rows_per_node = [offers[node][shard] for node, shard in enumerate(assigned)]
        return Placement(
            mine.path, rows_per_node, ShardUse(shard=mine.shard, rows=mine.rows, source=ShardSource.REUSED)
        )

    def missed(self) -> ShardUse:
        """What a node whose reuse attempt missed tells the driver."""
        return ShardUse(shard=self.node_rank, rows=0, source=ShardSource.MISSED)

    def close(self) -> None:
        for held in self.held:
            held.release()
        if self.temp is not None:
            shutil.rmtree(self.temp, ignore_errors=True)
            self.temp = None
        lock, self.lock = self.lock, None
        if lock is not None:
            os.close(lock)


def _drain(batches: Iterable[Any] | None) -> None:
    for _ in batches or ():  # the placeholder row of a stage without data
        pass


def node_shard(run: RunSpec, node_rank: int, workdir: str, batches: Iterable[Any] | None) -> NodeShard:
    """This node's rows before the rendezvous (see the module docstring). Raises
    :class:`~spark_torch.shared.column_files.NullValuesError` for nulls in a numeric column."""
    data = run.data
    assert data is not None, "only run_on_dataframe stages rows"
    cache = data.cache
    if cache is None:
        path, rows = write_node_data(batches or (), workdir)
        return NodeShard(node_rank, path=path, rows=rows)
    folder = usable_cache(cache.root or scratch_root())
    if cache.reuse:
        _drain(batches)
        return NodeShard(node_rank, held=held_shards(folder, cache.key, cache.generation) if folder else [])
    if folder is None:  # nowhere that Spark removes with the application: this run only
        path, rows = write_node_data(batches or (), workdir)
        return NodeShard(node_rank, path=path, rows=rows, source=ShardSource.PRIVATE)
    temp, lock = start_shard(folder, cache.key, cache.generation, node_rank)
    shard = NodeShard(node_rank, temp=temp, lock=lock)
    try:
        writer = ColumnWriter(temp)
        for batch in batches or ():
            writer.write(batch)
        shard.rows = writer.close()
        final = publish(temp, lock, folder, cache.key, cache.generation, node_rank)
    except BaseException:
        shard.close()
        raise
    if final is None:  # the name is taken: this copy serves this attempt only
        shard.path, shard.source = temp, ShardSource.PRIVATE
        return shard
    shard.temp, shard.path, shard.source = None, final, ShardSource.KEPT
    sweep(folder, cache.key, keep=cache.generation)  # the key's older generations nobody uses
    return shard
