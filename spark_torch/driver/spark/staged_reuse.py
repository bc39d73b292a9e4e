"""Driver side of ``run_on_dataframe(..., reuse_staged=True)``: which DataFrame rows were kept.

:func:`plan_digest` names a DataFrame's rows in this session: its optimized plan with Spark's
expression ids normalised (filters, projections, literals, seeds), Spark's semantic hash of it,
its input files, and the identity of in-memory leaves (an RDD's id, a local relation's rows),
with spark_torch's own identity and the kept files' format. :class:`KeptRows` adds the columns
and the layout (mode, nodes, ranks per node) to make one attempt's key, decides whether the
attempt stages or reuses, and remembers, per Spark application, the generation of each key whose
every node kept its shard (:mod:`spark_torch.shared.staged_shards` is the folder's layout). In
local mode the shards are kept in the driver's ``SparkFiles.getRootDirectory()``, which Spark
removes when the session stops; this module also removes them itself when it finds their session
stopped, and when the interpreter exits.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import shutil
import threading
from dataclasses import dataclass, replace
from typing import Any

from spark_torch.errors import ConfigurationError
from spark_torch.shared.spec import LaunchPlan, StagedCache
from spark_torch.shared.staged_shards import CACHE_DIR, ShardSource, ShardUse, Staging, new_generation
from spark_torch.version import package_identity

__all__ = ["FORMAT", "plan_digest", "KeptRows"]

logger = logging.getLogger(__name__)

#: the kept files' format (column_files' layout and the key's fields): a change makes new keys
FORMAT = "spark-torch-staged-1"

_lock = threading.Lock()
#: per Spark application id: key -> the generation every node kept
_kept: dict[str, dict[str, str]] = {}
#: per Spark application id: the driver's folder of kept shards (local mode)
_driver_folders: dict[str, str] = {}


def plan_digest(df: Any) -> str:
    """The digest naming ``df``'s rows in this session (see the module docstring). Raises
    :class:`ConfigurationError` under Spark Connect."""
    if type(df).__module__.startswith("pyspark.sql.connect"):
        raise ConfigurationError(
            "reuse_staged=True needs a classic Spark session: under Spark Connect the executors belong to "
            "the Connect server's application, which outlives your session, so the kept rows would outlive "
            "it too. Drop reuse_staged (each run stages its rows again)"
        )
    plan = df._jdf.queryExecution().optimizedPlan()
    parts = [
        FORMAT,
        package_identity(),
        plan.canonicalized().toString(),
        str(df.semanticHash()),
        *sorted(df.inputFiles()),
    ]
    leaves = plan.collectLeaves()
    for index in range(leaves.size()):
        leaf = leaves.apply(index)
        kind = leaf.getClass().getName()
        if kind.endswith(".LogicalRDD"):  # in-memory rows (createDataFrame): the RDD is the identity
            parts.append(f"rdd {leaf.rdd().id()}")
        elif kind.endswith(".LocalRelation"):
            parts.append(f"local {leaf.data().toString()}")
    return hashlib.sha256("\0".join(parts).encode("utf-8")).hexdigest()


def _app_id(spark: Any) -> str:
    return str(spark.sparkContext.applicationId)


def _forget_stopped() -> None:
    """Drop what is known of applications that stopped, and remove their driver folders."""
    from pyspark import SparkContext

    active = SparkContext._active_spark_context
    live = active.applicationId if active is not None else None
    with _lock:
        stopped = [app for app in set(_kept) | set(_driver_folders) if app != live]
        folders = [_driver_folders.pop(app) for app in stopped if app in _driver_folders]
        for app in stopped:
            _kept.pop(app, None)
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)


@atexit.register
def _remove_driver_folders() -> None:  # pragma: no cover - runs at interpreter exit
    with _lock:
        folders = list(_driver_folders.values())
        _driver_folders.clear()
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)


def _driver_root(spark: Any) -> str:
    """Local mode: the driver's SparkFiles root (Spark removes it when the session stops)."""
    root = str(spark.sparkContext._jvm.org.apache.spark.SparkFiles.getRootDirectory())
    with _lock:
        _driver_folders[_app_id(spark)] = os.path.join(root, CACHE_DIR)
    return root


@dataclass
class KeptRows:
    """One attempt's kept rows: its key, where they are kept, and the generation it uses."""

    spark: Any
    key: str
    #: local mode: the driver's folder; None: each executor's Spark local dir
    root: str | None

    @classmethod
    def for_attempt(
        cls, spark: Any, digest: str, columns: tuple[str, ...], explicit: bool, plan: LaunchPlan
    ) -> KeptRows:
        """The attempt's key: the DataFrame's digest, the columns, tuples or dicts, the layout."""
        _forget_stopped()
        layout = [digest, list(columns), explicit, plan.local_mode, plan.num_nodes, plan.procs_per_node]
        key = hashlib.sha256(json.dumps(layout).encode("utf-8")).hexdigest()
        return cls(spark=spark, key=key, root=_driver_root(spark) if plan.local_mode else None)

    def first(self) -> StagedCache:
        """Reuse the generation every node kept, if one is known; else stage a new one."""
        with _lock:
            generation = _kept.get(_app_id(self.spark), {}).get(self.key)
        if generation is not None:
            logger.info("spark_torch: reusing the DataFrame rows a previous run staged (key %s)", self.key[:12])
            return StagedCache(key=self.key, generation=generation, reuse=True, root=self.root)
        return self.restage()

    def restage(self) -> StagedCache:
        """Stage a new generation from the DataFrame."""
        return StagedCache(key=self.key, generation=new_generation(), reuse=False, root=self.root)

    def settle(
        self, cache: StagedCache, shards: dict[int, ShardUse], nodes: int, missed_before: bool
    ) -> Staging | None:
        """How this attempt got its rows (None: its nodes did not all get them), remembering a
        generation every node kept (or forgetting one some node missed)."""
        if len(shards) < nodes or any(use.source is ShardSource.MISSED for use in shards.values()):
            return None
        app = _app_id(self.spark)
        sources = {use.source for use in shards.values()}
        if sources == {ShardSource.REUSED}:
            return Staging.REUSED
        with _lock:
            if sources == {ShardSource.KEPT}:
                _kept.setdefault(app, {})[self.key] = cache.generation
            else:
                _kept.get(app, {}).pop(self.key, None)
        if ShardSource.PRIVATE in sources:
            return Staging.NOT_KEPT
        return Staging.RESTAGED if missed_before else Staging.STAGED

    def missed(self, cache: StagedCache) -> StagedCache:
        """The kept generation did not cover every node: forget it, and stage a new one."""
        logger.info(
            "spark_torch: the kept DataFrame rows are not on every node; staging them again (key %s)", self.key[:12]
        )
        with _lock:
            _kept.get(_app_id(self.spark), {}).pop(self.key, None)
        return replace(self.restage(), root=cache.root)
