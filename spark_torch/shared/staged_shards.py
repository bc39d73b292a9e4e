"""Staged DataFrame rows kept between runs (``run_on_dataframe(..., reuse_staged=True)``): the
folder they are kept in, their names, and the locks that keep a shard in use from being removed.

One owner for the layout, used by the node (:mod:`spark_torch.node.shard_reuse`, which stages
into it and takes shards from it) and by the driver (:mod:`spark_torch.driver.spark.staged_reuse`,
which removes the driver's own folder). A node's share of the DataFrame is one *shard*: a folder of
column files (:mod:`spark_torch.shared.column_files`) named ``KEY-GENERATION-SHARD`` inside the
private (0700) folder :data:`CACHE_DIR` of a Spark local directory: the executor's (Spark removes it
with the executor at the end of the application), or, in local mode, the driver's
``SparkFiles.getRootDirectory()`` (removed when the session stops). ``KEY`` is the driver's digest
of the DataFrame's plan, the columns and the layout; ``GENERATION`` is one staging of it (a restage
writes a new generation, so two stagings never write to one name); ``SHARD`` is the node that
staged it.

A shard is written under a temporary name (``.tmp-...``) while its writer holds an exclusive
``flock`` on it, then renamed: a folder with a final name is complete. A run that uses a shard
holds a shared ``flock`` on it until its ranks are done; :func:`sweep` removes only what it can
lock exclusively (older generations, temporary folders of writers that died), so a shard in use
by a running attempt is never removed.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import secrets
import shutil
from dataclasses import dataclass

from spark_torch.base.states import ShardSource, ShardUse, ValueEnum
from spark_torch.shared.column_files import MANIFEST
from spark_torch.shared.owned_files import UnsafePathError, own_directory

__all__ = [
    "CACHE_DIR",
    "Staging",
    "ShardSource",
    "ShardUse",
    "HeldShard",
    "cache_dir",
    "shard_name",
    "new_generation",
    "start_shard",
    "publish",
    "held_shards",
    "sweep",
    "usable_cache",
]

#: the folder of kept shards inside a Spark local directory (not ``spark-torch-*``: that is a
#: run's scratch directory, removed at the run's end)
CACHE_DIR = "spark_torch_staged"
_TEMP = ".tmp-"
_NAME = re.compile(r"^([0-9a-f]{32})-([0-9a-f]{12})-([0-9]+)$")


class Staging(ValueEnum):
    """How a ``run_on_dataframe(..., reuse_staged=True)`` call got its rows to the ranks
    (``RunResult.staging``)."""

    #: staged from the DataFrame and kept for the next run with the same key
    STAGED = "staged"
    #: every node trained on the rows an earlier run kept; the DataFrame was not read
    REUSED = "reused"
    #: the kept rows were not found on every node (an executor was lost, tasks landed on other
    #: executors): staged again from the DataFrame, and kept
    RESTAGED = "restaged"
    #: staged from the DataFrame, but some node could not keep its rows (no usable Spark local
    #: directory): the next run stages again
    NOT_KEPT = "not kept"


def cache_dir(root: str) -> str:
    """``root``'s folder of kept shards, created private (0700) and checked to be this user's;
    raises :class:`~spark_torch.shared.owned_files.UnsafePathError` for one that is not."""
    path = os.path.join(root, CACHE_DIR)
    os.close(own_directory(path, private=True))
    return path


def shard_name(key: str, generation: str, shard: int) -> str:
    """The final name of ``shard`` of ``key``'s ``generation``."""
    return f"{key[:32]}-{generation}-{shard}"


def new_generation() -> str:
    """A fresh generation id (one staging of a key)."""
    return secrets.token_hex(6)


def _lock(path: str, mode: int) -> int | None:
    """A descriptor of the folder ``path`` holding ``flock(mode)`` (non-blocking), or None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def start_shard(cache: str, key: str, generation: str, shard: int) -> tuple[str, int]:
    """A new temporary folder for writing ``shard`` (0700) and the descriptor holding its
    exclusive lock (a sweep leaves it alone while the writer lives)."""
    for _ in range(3):
        path = os.path.join(cache, f"{_TEMP}{shard_name(key, generation, shard)}-{secrets.token_hex(4)}")
        os.mkdir(path, 0o700)
        fd = _lock(path, fcntl.LOCK_EX)
        # another node's sweep may take a temporary folder in the moment before it is locked
        if fd is not None and os.fstat(fd).st_nlink > 0:
            return path, fd
        if fd is not None:
            os.close(fd)
    raise OSError(f"could not start a shard in {cache}: its folders kept disappearing")


def publish(temp: str, lock: int, cache: str, key: str, generation: str, shard: int) -> str | None:
    """Rename the complete ``temp`` folder to its final name and turn its lock into a shared
    one (this run reads it); the final path, or None when the name is taken (``temp`` stays)."""
    final = os.path.join(cache, shard_name(key, generation, shard))
    try:
        os.rename(temp, final)  # never over an existing folder (ENOTEMPTY/EEXIST)
    except OSError:
        return None
    fcntl.flock(lock, fcntl.LOCK_SH)
    return final


@dataclass
class HeldShard:
    """A kept shard this node holds a shared lock on (released by :meth:`release`)."""

    shard: int
    rows: int
    path: str
    fd: int | None

    def release(self) -> None:
        """Let the shard go (a sweep may remove it once no run holds it)."""
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)


def _rows(fd: int) -> int | None:
    """The rows of the complete shard open at ``fd`` (None: no readable manifest)."""
    import json

    try:
        manifest = os.open(MANIFEST, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
        with os.fdopen(manifest) as fh:
            return int(json.load(fh)["rows"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def held_shards(cache: str, key: str, generation: str) -> list[HeldShard]:
    """The complete shards of ``key``'s ``generation`` in ``cache``, each locked (shared) so that
    no sweep removes it while this node may train on it."""
    held: list[HeldShard] = []
    try:
        names = sorted(os.listdir(cache))
    except OSError:
        return held
    for name in names:
        match = _NAME.match(name)
        if match is None or match.group(1) != key[:32] or match.group(2) != generation:
            continue
        path = os.path.join(cache, name)
        fd = _lock(path, fcntl.LOCK_SH)
        if fd is None:
            continue
        rows = _rows(fd)  # read after locking: a sweep that removed it first left no manifest
        if rows is None:
            os.close(fd)
            continue
        held.append(HeldShard(shard=int(match.group(3)), rows=rows, path=path, fd=fd))
    return held


def sweep(cache: str, key: str, keep: str) -> list[str]:
    """Remove ``key``'s shards of generations other than ``keep`` and temporary folders whose
    writer is gone, each only when no run holds it (an exclusive lock is had); returns what was
    removed."""
    removed: list[str] = []
    try:
        names = os.listdir(cache)
    except OSError:
        return removed
    for name in names:
        match = _NAME.match(name)
        old = match is not None and match.group(1) == key[:32] and match.group(2) != keep
        if not old and not name.startswith(_TEMP):
            continue
        path = os.path.join(cache, name)
        fd = _lock(path, fcntl.LOCK_EX)
        if fd is None:  # in use (or being written)
            continue
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(path, MANIFEST))  # a reader locking it after us finds it incomplete
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        finally:
            os.close(fd)
    return removed


def usable_cache(root: str | None) -> str | None:
    """``root``'s folder of kept shards, or None when there is no root or it is not this user's."""
    if not root:
        return None
    try:
        return cache_dir(root)
    except (UnsafePathError, OSError):
        return None
