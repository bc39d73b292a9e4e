"""Where a run's checkpoints and metrics live: a directory or any fsspec URL (``s3://``,
``gs://``, ``abfss://``, ``dbfs:/``... wherever the filesystem package is installed).

Layout of one run::

    STORAGE/RUN_ID/checkpoint_000005/...            files the ranks wrote (merged)
    STORAGE/RUN_ID/checkpoint_000005/.spark_torch   manifest, written last by the driver (with
                                                    the step's metrics): a checkpoint without
                                                    it is incomplete
    STORAGE/RUN_ID/metrics.jsonl                    one JSON row per report() of rank 0
    STORAGE/RUN_ID/attempts.jsonl                   one JSON row per attempt started (its
                                                    number, world size, nodes, time)
    STORAGE/RUN_ID/run.jsonl                        each run() call's start and end, each attempt's end
    STORAGE/RUN_ID/.spark_torch_run                 the marker of a run's directory

A checkpoint counts only once its manifest exists, so a crash while ranks upload never leaves a
half-written "latest" checkpoint. On a local (or mounted) filesystem the ranks' files and the
manifest are fsynced before report() returns, and the run's folder and files are private
(:mod:`~spark_torch.reporting.local_files`); an object store has them once its write returns. Used by ranks (upload),
node runners (download) and the driver
(manifests, metrics, pruning); imports neither torch nor pyspark. One class over one layout,
kept whole so that every path of the layout is written in one place; which checkpoints are
best is :mod:`spark_torch.reporting.ranking`.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import posixpath
import re
import time
from collections.abc import Callable, Mapping
from typing import Any

from spark_torch.reporting.local_files import listed_runs, remove_run, run_folder
from spark_torch.reporting.ranking import CheckpointInfo, best
from spark_torch.reporting.redaction import options_withheld
from spark_torch.reporting.storage_urls import is_local_url, local_base, split_run_path, storage_error

__all__ = [
    "RunStorage",
    "MANIFEST",
    "DEFAULT_STORAGE",
    "RUN_LOG",
    "local_base",
    "storage_error",
    "options_withheld",
    "run_ids",
    "split_run_path",
]

MANIFEST = ".spark_torch"
METRICS = "metrics.jsonl"
ATTEMPTS = "attempts.jsonl"
RUN_LOG = "run.jsonl"
#: written by the driver when a run() starts: ranks check they see the same storage
RUN_MARKER = ".spark_torch_run"
#: where runs go when ``storage_path`` is not given
DEFAULT_STORAGE = os.path.join("~", "spark_torch_runs")
_CHECKPOINT = re.compile(r"^checkpoint_(\d{6,})$")


def _withholding_options(method: Callable[..., Any]) -> Callable[..., Any]:
    """A :class:`RunStorage` method under :func:`options_withheld`."""

    @functools.wraps(method)
    def call(self: RunStorage, *args: Any, **kwargs: Any) -> Any:
        with options_withheld(self.options):
            return method(self, *args, **kwargs)

    return call


def run_ids(base: str, options: Mapping[str, Any] | None) -> list[str]:
    """The runs under the storage ``base`` (directories holding a run marker), by name; none
    when ``base`` does not exist."""
    base = local_base(base)
    options = dict(options or {})
    with options_withheld(options):
        if is_local_url(base):
            return listed_runs(os.path.expanduser(base), RUN_MARKER)  # links and other users' not listed
        from fsspec.core import url_to_fs

        fs, root = url_to_fs(base.rstrip("/"), **options)
        try:
            children = fs.ls(root, detail=False)
        except FileNotFoundError:
            return []
        names = [posixpath.basename(str(c).rstrip("/")) for c in children]
        return sorted(n for n in names if fs.exists(posixpath.join(root, n, RUN_MARKER)))


class RunStorage:
    """The storage of one run (``base``/``run_id``). No error of its methods quotes a value of
    the storage options (:func:`options_withheld`).

    The one way every side opens a run's storage; ``options`` (fsspec's, with credentials) is a
    required argument, so no side opens it without them by omission (None or ``{}``: none)."""

    def __init__(self, base: str, run_id: str, options: Mapping[str, Any] | None) -> None:
        base = local_base(base)
        self.base = os.path.abspath(os.path.expanduser(base)) if is_local_url(base) else base.rstrip("/")
        self.run_id = run_id
        #: fsspec's keyword arguments for the filesystem (credentials, endpoint...)
        self.options = dict(options or {})
        self.local = is_local_url(self.base)
        self.url = os.path.join(self.base, run_id) if self.local else f"{self.base}/{run_id}"
        self._fs: Any = None
        self._root = self.url

    # filesystem plumbing
    @property
    def fs(self) -> Any:
        """The fsspec filesystem (imported on first use)."""
        if self._fs is None:
            from fsspec.core import url_to_fs

            self._fs, self._root = url_to_fs(self.url, **self.options)
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

    @_withholding_options
    def create(self, token: str) -> None:
        """Make the run's directory and mark it with ``token`` (the driver, before ranks start)."""
        if self.local:
            with run_folder(
                self.base, self.run_id, create=True
            ) as run:  # private (0700) unless the storage is a team's
                run.write(RUN_MARKER, token)
        else:
            self.fs.makedirs(self._path(), exist_ok=True)
            self.fs.pipe_file(self._path(RUN_MARKER), token.encode("utf-8"))

    @_withholding_options
    def exists(self) -> bool:
        """Whether the run's directory exists (a run of this id was started here)."""
        if self.local:
            return os.path.isdir(self.url)
        return bool(self.fs.exists(self._path()))

    @_withholding_options
    def is_run(self) -> bool:
        """Whether the run's directory holds a run's marker (a run of this id was started here)."""
        if self.local:
            return os.path.isfile(os.path.join(self.url, RUN_MARKER))
        return bool(self.fs.exists(self._path(RUN_MARKER)))

    @_withholding_options
    def visible(self, token: str) -> bool:
        """Whether this host sees the driver's run directory (the same ``token`` in its marker)."""
        try:
            if self.local:
                with run_folder(self.base, self.run_id) as run:  # refused: raises (the node says why)
                    return run.read(RUN_MARKER) == token.encode("utf-8")
            return bool(self.fs.cat_file(self._path(RUN_MARKER)).decode("utf-8") == token)
        except (OSError, UnicodeDecodeError):
            return False

    @_withholding_options
    def holds_only_logs(self) -> bool:
        """Whether nothing but the run's marker and logs is in its directory (it reported nothing
        and kept no checkpoint): one listing, no log read."""
        return not set(self._names()) - {RUN_MARKER, ATTEMPTS, RUN_LOG}

    @_withholding_options
    def remove_if_unused(self) -> bool:
        """Remove the run's directory if nothing but its marker and logs are in it (a run that reported nothing)."""
        if not self.holds_only_logs():
            return False
        if self.local:
            with contextlib.suppress(OSError):
                remove_run(self.base, self.run_id)
        else:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm(self._path(), recursive=True)
        return True

    # ranks
    @_withholding_options
    def upload(self, local_dir: str, step: int) -> None:
        """Copy the files of ``local_dir`` into checkpoint ``step`` (merging with other ranks')."""
        if not os.path.isdir(local_dir):
            raise FileNotFoundError(f"report(checkpoint={local_dir!r}): not a directory")
        target = self.checkpoint_url(step)
        name = posixpath.basename(target)
        if self.local:
            with run_folder(self.base, self.run_id) as run:
                run.copy_in(local_dir, name)
            return
        for root, _dirs, files in os.walk(local_dir):
            relative = os.path.relpath(root, local_dir)
            remote_dir = posixpath.join(self._path(name), *([] if relative == "." else relative.split(os.sep)))
            self.fs.makedirs(remote_dir, exist_ok=True)
            for file in files:
                self.fs.put_file(os.path.join(root, file), posixpath.join(remote_dir, file))

    # driver
    @_withholding_options
    def complete(
        self,
        step: int,
        attempt: int,
        ranks: list[int],
        metrics: Mapping[str, Any] | None = None,
        loaders: Mapping[str, Any] | None = None,
    ) -> None:
        """Mark checkpoint ``step`` complete: write its manifest (last), with the step's metrics
        and the ranks' data loaders' positions (:mod:`~spark_torch.reporting.loader_positions`)."""
        content: dict[str, Any] = {
            "step": step,
            "attempt": attempt,
            "time": time.time(),
            "ranks": ranks,
            "metrics": dict(metrics or {}),
        }
        if loaders:
            content["loaders"] = dict(loaders)
        manifest = json.dumps(content, default=str)
        name = f"checkpoint_{step:06d}"
        if self.local:
            with run_folder(self.base, self.run_id) as run:
                run.write(MANIFEST, manifest, folder=name, atomic=True)  # fsynced, renamed, the rename fsynced
        else:
            self.fs.makedirs(self._path(name), exist_ok=True)
            self.fs.pipe_file(self._path(name, MANIFEST), manifest.encode("utf-8"))

    def _names(self) -> list[str]:
        if self.local:
            try:
                with run_folder(self.base, self.run_id) as run:
                    return run.names()
            except FileNotFoundError:
                return []
        try:
            return [posixpath.basename(p.rstrip("/")) for p in self.fs.ls(self._path(), detail=False)]
        except FileNotFoundError:
            return []

    def _manifest(self, name: str) -> dict[str, Any] | None:
        """A checkpoint's manifest, or None while it is incomplete."""
        try:
            if self.local:
                with run_folder(self.base, self.run_id) as run:
                    raw = run.read(name, MANIFEST)
                if raw is None:
                    return None
            else:
                raw = self.fs.cat_file(self._path(name, MANIFEST))
        except (FileNotFoundError, NotADirectoryError):
            return None
        try:
            data = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            return {}  # written by hand or cut short: complete, without details
        return data if isinstance(data, dict) else {}

    @_withholding_options
    def checkpoints(self) -> tuple[list[CheckpointInfo], list[int]]:
        """(complete checkpoints by step, steps of incomplete checkpoint directories)."""
        complete, incomplete = [], []
        for name in self._names():
            match = _CHECKPOINT.match(name)
            if not match:
                continue
            step = int(match.group(1))
            manifest = self._manifest(name)
            if manifest is not None:
                metrics = manifest.get("metrics")
                complete.append(
                    CheckpointInfo(
                        step=step,
                        url=self.checkpoint_url(step),
                        attempt=int(manifest.get("attempt") or 0),
                        metrics=metrics if isinstance(metrics, dict) else {},
                    )
                )
            else:
                incomplete.append(step)
        return sorted(complete, key=lambda c: c.step), sorted(incomplete)

    @_withholding_options
    def latest(self) -> CheckpointInfo | None:
        """The newest complete checkpoint, or None."""
        complete, _ = self.checkpoints()
        return complete[-1] if complete else None

    @_withholding_options
    def remove_checkpoint(self, step: int) -> None:
        """Delete checkpoint ``step`` (complete or not)."""
        name = f"checkpoint_{step:06d}"
        if self.local:
            with contextlib.suppress(OSError), run_folder(self.base, self.run_id) as run:
                run.remove(name)
        else:
            try:
                self.fs.rm(self._path(name), recursive=True)
            except FileNotFoundError:
                pass

    @_withholding_options
    def discard_incomplete_after(self, step: int) -> None:
        """Before an attempt starts (no rank running): drop partial checkpoints newer than ``step``."""
        _, incomplete = self.checkpoints()
        for partial in incomplete:
            if partial > step:
                self.remove_checkpoint(partial)

    @_withholding_options
    def prune(self, keep: int, score: str | None = None, order: str = "max") -> list[int]:
        """Keep ``keep`` complete checkpoints: the newest ones, or with ``score`` the best by that
        metric (``order`` "max" or "min"; without the metric: worst); the latest is always kept
        too (a restart resumes from it). Returns removed steps. Incomplete ones are never
        touched here: one may be being written."""
        complete, _ = self.checkpoints()
        if not complete:
            return []
        kept = {c.step for c in best(complete, score, order)[: max(1, keep)]} | {complete[-1].step}
        old = [c.step for c in complete if c.step not in kept]
        for step in old:
            self.remove_checkpoint(step)
        return old

    @_withholding_options
    def read_log(self, name: str) -> list[dict[str, Any]]:
        """The rows of one of the run's JSON-lines logs (a line cut short by a crash: skipped)."""
        try:
            if self.local:
                with run_folder(self.base, self.run_id) as run:
                    raw = run.read(name) or b""
            else:
                raw = self.fs.cat_file(self._path(name))
        except FileNotFoundError:
            return []
        rows = []
        for line in raw.decode("utf-8", errors="replace").splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict):
                rows.append(row)
        return rows

    @_withholding_options
    def next_attempt(self) -> int:
        """The index of the run's next attempt in its history: one more than the last one
        started (its attempt log) or that reported a step (0 for a new run), so a run resumed by
        a later ``run()`` call counts on."""
        seen = [int(r.get("attempt") or 0) for r in (*self.attempts(), *self.history())]
        return max(seen, default=-1) + 1

    @_withholding_options
    def append_log(self, name: str, row: Mapping[str, Any]) -> None:
        """Append one row to one of the run's JSON-lines logs."""
        line = json.dumps(row, default=str) + "\n"
        if self.local:
            with run_folder(self.base, self.run_id) as run:
                run.append(name, line)
            return
        path = self._path(name)
        try:
            with self.fs.open(path, "ab") as fh:
                fh.write(line.encode("utf-8"))
        except (NotImplementedError, ValueError):  # object stores cannot append: rewrite
            old = self.fs.cat_file(path) if self.fs.exists(path) else b""
            self.fs.pipe_file(path, old + line.encode("utf-8"))

    @_withholding_options
    def record_attempt(
        self, attempt: int, world_size: int, nodes: int, score: str | None = None, order: str = "max"
    ) -> None:
        """Note that an attempt started (the driver, before its ranks start), with the
        checkpoint score it ranks checkpoints by (:func:`recorded_score` reads it back)."""
        row: dict[str, Any] = {"attempt": attempt, "world_size": world_size, "nodes": nodes, "time": time.time()}
        if score:
            row.update(checkpoint_score_attribute=score, checkpoint_score_order=order)
        self.append_log(ATTEMPTS, row)

    @_withholding_options
    def attempts(self) -> list[dict[str, Any]]:
        """One row per attempt started, oldest first: ``attempt`` (numbered on across ``run()``
        calls with this run id), ``world_size``, ``nodes``, ``time`` (Unix seconds)."""
        return list(self.read_log(ATTEMPTS))

    @_withholding_options
    def history(self) -> list[dict[str, Any]]:
        """Every reported step of the run, across attempts and ``run()`` calls with this run id:
        one row per step (a step reported again after a restart: the newest row)."""
        rows = {row["step"]: row for row in self.read_log(METRICS) if isinstance(row.get("step"), int)}
        return [rows[step] for step in sorted(rows)]

    @_withholding_options
    def append_metrics(self, row: dict[str, Any]) -> None:
        """Append one row to the run's metrics log."""
        self.append_log(METRICS, row)

    # nodes
    @_withholding_options
    def download(self, checkpoint: CheckpointInfo, local_dir: str) -> str:
        """The checkpoint as a local directory: itself for local storage, else a copy in ``local_dir``
        (by its URL: it may be another run's in the same storage, a replica group's peer's)."""
        if self.local:  # its run's folder and itself checked here, on the node, before a rank reads it
            run_dir, name = os.path.split(checkpoint.url)
            with run_folder(*os.path.split(run_dir)) as run, run.folder(name):
                return checkpoint.url
        from fsspec.core import url_to_fs

        fs, path = url_to_fs(checkpoint.url, **self.options)
        fs.get(path, local_dir, recursive=True)
        return local_dir
