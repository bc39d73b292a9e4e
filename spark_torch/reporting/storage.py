"""Where a run's checkpoints and metrics live: a directory or any fsspec URL (``s3://``,
``gs://``, ``abfss://``, ``dbfs:/``... wherever the filesystem package is installed).

Layout of one run::

    STORAGE/RUN_ID/checkpoint_000005/...            files the ranks wrote (merged)
    STORAGE/RUN_ID/checkpoint_000005/.spark_torch   manifest, written last by the driver:
                                                    a checkpoint without it is incomplete
    STORAGE/RUN_ID/metrics.jsonl                    one JSON row per report() of rank 0

A checkpoint counts only once its manifest exists, so a crash while ranks upload never leaves a
half-written "latest" checkpoint. On a local (or mounted) filesystem the ranks' files and the
manifest are fsynced before report() returns; an object store has them once its write returns. Used by ranks (upload), node runners (download) and the driver
(manifests, metrics, pruning); imports neither torch nor pyspark.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
import shutil
import time
from dataclasses import dataclass
from typing import Any

__all__ = ["RunStorage", "CheckpointInfo", "MANIFEST", "DEFAULT_STORAGE"]

MANIFEST = ".spark_torch"
METRICS = "metrics.jsonl"
#: written by the driver when a run() starts: ranks check they see the same storage
RUN_MARKER = ".spark_torch_run"
#: where runs go when ``storage_path`` is not given
DEFAULT_STORAGE = os.path.join("~", "spark_torch_runs")
_CHECKPOINT = re.compile(r"^checkpoint_(\d{6,})$")


@dataclass(frozen=True)
class CheckpointInfo:
    """A complete checkpoint: its step and where it is."""

    step: int
    url: str
    attempt: int = 0


def _is_local(url: str) -> bool:
    return "://" not in url and not url.startswith("dbfs:")


def _fsync(path: str, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_copy(source: str, target: str) -> None:
    """Flush to disk what was copied from ``source`` into ``target`` (its files and their
    directories): a checkpoint is durable before report() returns, not only in the page cache."""
    for dirpath, _dirs, files in os.walk(source):
        copied = os.path.join(target, os.path.relpath(dirpath, source))
        for name in files:
            _fsync(os.path.join(copied, name))
        _fsync(copied, directory=True)
    _fsync(os.path.dirname(target), directory=True)


class RunStorage:
    """The storage of one run (``base``/``run_id``)."""

    def __init__(self, base: str, run_id: str) -> None:
        self.base = os.path.abspath(os.path.expanduser(base)) if _is_local(base) else base.rstrip("/")
        self.run_id = run_id
        self.local = _is_local(self.base)
        self.url = os.path.join(self.base, run_id) if self.local else f"{self.base}/{run_id}"
        self._fs: Any = None
        self._root = self.url

    # filesystem plumbing
    @property
    def fs(self) -> Any:
        """The fsspec filesystem (imported on first use)."""
        if self._fs is None:
            from fsspec.core import url_to_fs

            self._fs, self._root = url_to_fs(self.url)
        return self._fs

    def _path(self, *parts: str) -> str:
        if self.local:
            return os.path.join(self.url, *parts)
        self.fs  # noqa: B018 - resolves _root
        return posixpath.join(self._root, *parts)

    def checkpoint_url(self, step: int) -> str:
        """Where checkpoint ``step`` lives (a local path for local storage)."""
        name = f"checkpoint_{step:06d}"
        return os.path.join(self.url, name) if self.local else f"{self.url}/{name}"

    def create(self, token: str) -> None:
        """Make the run's directory and mark it with ``token`` (the driver, before ranks start)."""
        if self.local:
            os.makedirs(self.url, exist_ok=True)
            with open(os.path.join(self.url, RUN_MARKER), "w", encoding="utf-8") as fh:
                fh.write(token)
        else:
            self.fs.makedirs(self._path(), exist_ok=True)
            self.fs.pipe_file(self._path(RUN_MARKER), token.encode("utf-8"))

    def visible(self, token: str) -> bool:
        """Whether this host sees the driver's run directory (the same ``token`` in its marker)."""
        try:
            if self.local:
                with open(os.path.join(self.url, RUN_MARKER), encoding="utf-8") as fh:
                    return fh.read() == token
            return bool(self.fs.cat_file(self._path(RUN_MARKER)).decode("utf-8") == token)
        except (OSError, UnicodeDecodeError):
            return False

    def remove_if_unused(self) -> bool:
        """Remove the run's directory if nothing but its marker is in it (a run that reported nothing)."""
        if set(self._names()) - {RUN_MARKER}:
            return False
        if self.local:
            shutil.rmtree(self.url, ignore_errors=True)
        else:
            try:
                self.fs.rm(self._path(), recursive=True)
            except FileNotFoundError:
                pass
        return True

    # ranks
    def upload(self, local_dir: str, step: int) -> None:
        """Copy the files of ``local_dir`` into checkpoint ``step`` (merging with other ranks')."""
        if not os.path.isdir(local_dir):
            raise FileNotFoundError(f"report(checkpoint={local_dir!r}): not a directory")
        target = self.checkpoint_url(step)
        if self.local:
            shutil.copytree(local_dir, target, dirs_exist_ok=True)
            _fsync_copy(local_dir, target)
            return
        name = posixpath.basename(target)
        for root, _dirs, files in os.walk(local_dir):
            relative = os.path.relpath(root, local_dir)
            remote_dir = posixpath.join(self._path(name), *([] if relative == "." else relative.split(os.sep)))
            self.fs.makedirs(remote_dir, exist_ok=True)
            for file in files:
                self.fs.put_file(os.path.join(root, file), posixpath.join(remote_dir, file))

    # driver
    def complete(self, step: int, attempt: int, ranks: list[int]) -> None:
        """Mark checkpoint ``step`` complete: write its manifest (last)."""
        manifest = json.dumps({"step": step, "attempt": attempt, "time": time.time(), "ranks": ranks})
        name = f"checkpoint_{step:06d}"
        if self.local:
            os.makedirs(os.path.join(self.url, name), exist_ok=True)
            path = os.path.join(self.url, name, MANIFEST)
            tmp = path + ".tmp"
            with open(tmp, "w", encoding="utf-8") as fh:
                fh.write(manifest)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
            _fsync(os.path.dirname(path), directory=True)  # the rename itself is durable
        else:
            self.fs.makedirs(self._path(name), exist_ok=True)
            self.fs.pipe_file(self._path(name, MANIFEST), manifest.encode("utf-8"))

    def _names(self) -> list[str]:
        if self.local:
            try:
                return os.listdir(self.url)
            except FileNotFoundError:
                return []
        try:
            return [posixpath.basename(p.rstrip("/")) for p in self.fs.ls(self._path(), detail=False)]
        except FileNotFoundError:
            return []

    def _has_manifest(self, name: str) -> bool:
        if self.local:
            return os.path.isfile(os.path.join(self.url, name, MANIFEST))
        return bool(self.fs.exists(self._path(name, MANIFEST)))

    def checkpoints(self) -> tuple[list[CheckpointInfo], list[int]]:
        """(complete checkpoints by step, steps of incomplete checkpoint directories)."""
        complete, incomplete = [], []
        for name in self._names():
            match = _CHECKPOINT.match(name)
            if not match:
                continue
            step = int(match.group(1))
            if self._has_manifest(name):
                complete.append(CheckpointInfo(step=step, url=self.checkpoint_url(step)))
            else:
                incomplete.append(step)
        return sorted(complete, key=lambda c: c.step), sorted(incomplete)

    def latest(self) -> CheckpointInfo | None:
        """The newest complete checkpoint, or None."""
        complete, _ = self.checkpoints()
        return complete[-1] if complete else None

    def remove_checkpoint(self, step: int) -> None:
        """Delete checkpoint ``step`` (complete or not)."""
        name = f"checkpoint_{step:06d}"
        if self.local:
            shutil.rmtree(os.path.join(self.url, name), ignore_errors=True)
        else:
            try:
                self.fs.rm(self._path(name), recursive=True)
            except FileNotFoundError:
                pass

    def discard_incomplete_after(self, step: int) -> None:
        """Before an attempt starts (no rank running): drop partial checkpoints newer than ``step``."""
        _, incomplete = self.checkpoints()
        for partial in incomplete:
            if partial > step:
                self.remove_checkpoint(partial)

    def prune(self, keep: int) -> list[int]:
        """Keep the newest ``keep`` complete checkpoints (never the latest); returns removed steps.
        Incomplete ones are never touched here: one may be being written."""
        complete, _ = self.checkpoints()
        old = [c.step for c in complete[: max(0, len(complete) - max(1, keep))]]
        for step in old:
            self.remove_checkpoint(step)
        return old

    def append_metrics(self, row: dict[str, Any]) -> None:
        """Append one row to the run's metrics log."""
        line = json.dumps(row, default=str) + "\n"
        if self.local:
            with open(os.path.join(self.url, METRICS), "a", encoding="utf-8") as fh:
                fh.write(line)
            return
        path = self._path(METRICS)
        try:
            with self.fs.open(path, "ab") as fh:
                fh.write(line.encode("utf-8"))
        except (NotImplementedError, ValueError):  # object stores cannot append: rewrite
            old = self.fs.cat_file(path) if self.fs.exists(path) else b""
            self.fs.pipe_file(path, old + line.encode("utf-8"))

    # nodes
    def download(self, checkpoint: CheckpointInfo, local_dir: str) -> str:
        """The checkpoint as a local directory: itself for local storage, else a copy in ``local_dir``."""
        if self.local:
            return checkpoint.url
        name = f"checkpoint_{checkpoint.step:06d}"
        self.fs.get(self._path(name), local_dir, recursive=True)
        return local_dir
