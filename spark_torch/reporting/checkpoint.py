"""A checkpoint as an object (:class:`Checkpoint`): a persisted one of a run (``RunResult``),
or a directory a rank wrote (:meth:`Checkpoint.from_directory`, as in Ray Train).

Lives in the reporting layer so that a rank can use it without loading the driver; imports
neither torch nor pyspark (fsspec only to fetch a remote checkpoint). It holds no storage option:
a :class:`~spark_torch.reporting.storage_keys.StorageKey` stands for them (the pickling rule).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import InitVar, dataclass, field
from pathlib import Path
from typing import Any

from spark_torch.reporting.ranking import CheckpointInfo
from spark_torch.reporting.redaction import options_withheld
from spark_torch.reporting.storage_keys import StorageKey, remember, resolve_options

__all__ = ["Checkpoint", "persisted_checkpoint"]


def _is_remote(path: str) -> bool:
    return "://" in path


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint: the files the ranks passed to ``report(checkpoint=...)``, once persisted, or
    a directory wrapped by :meth:`from_directory`.

    ``path`` is a local directory, or a URL for object storage; ``str(checkpoint)`` and
    ``os.fspath(checkpoint)`` give it too, so a checkpoint goes wherever a path does (``open``,
    ``os.path.join``, ``report``'s ``checkpoint=``), and ``checkpoint / "state.pt"`` is the
    ``pathlib.Path`` of a file in a local one (what :func:`spark_torch.get_checkpoint` returned
    before it returned a ``Checkpoint``). :meth:`to_directory` and :meth:`as_directory` always
    give a local directory.

    A checkpoint on remote storage holds no storage option (no credential), so neither does
    its pickle, copy, ``dataclasses.asdict`` or ``vars()``: ``storage_options=`` given when it is
    made go to this process's memory, and ``storage_key`` stands for them there. Opened in
    another process (a pickled result), it needs them again: ``to_directory(storage_options=...)``,
    ``as_directory(storage_options=...)``, or ``SPARK_TORCH_STORAGE_OPTIONS``
    (:mod:`~spark_torch.reporting.storage_keys`).
    """

    path: str
    #: the step it was persisted at; 0 for a directory not (yet) persisted by a run
    step: int = 0
    #: the metrics reported with it (rank 0's, plus ``step``, ``time``, ``attempt``, ``world_size``)
    metrics: dict[str, Any] = field(default_factory=dict)
    #: stands for the storage options it opens with, in this process (None: none)
    storage_key: StorageKey | None = field(default=None, repr=False, compare=False)
    #: fsspec's options for its storage: kept in this process's memory, not in the checkpoint
    storage_options: InitVar[Mapping[str, Any] | None] = None

    def __post_init__(self, storage_options: Mapping[str, Any] | None) -> None:
        if storage_options:
            object.__setattr__(self, "storage_key", remember(storage_options))

    def __fspath__(self) -> str:
        return self.path

    def __str__(self) -> str:
        return self.path

    def __hash__(self) -> int:  # a set or dict key, as a path was (the metrics are a dict)
        return hash((self.path, self.step))

    def __truediv__(self, name: str | os.PathLike[str]) -> Path:
        """``checkpoint / "state.pt"``: the path of a file in this (local) checkpoint.

        Raises:
            ValueError: the checkpoint is on remote storage (use :meth:`as_directory`).
        """
        if _is_remote(self.path):
            raise ValueError(
                f"{self.path} / {os.fspath(name)!r}: the checkpoint is on remote storage, not a local path; "
                "use `with checkpoint.as_directory() as d:` and read the files under d"
            )
        return Path(self.path) / name

    @classmethod
    def from_directory(cls, path: str | os.PathLike[str]) -> Checkpoint:
        """A checkpoint of the files in the local directory ``path`` (Ray Train's
        ``Checkpoint.from_directory``); pass it to ``report(metrics, checkpoint=...)``.

        Raises:
            NotADirectoryError: ``path`` is not an existing local directory.
        """
        text = os.fspath(path)
        if _is_remote(text) or not os.path.isdir(text):
            raise NotADirectoryError(
                f"Checkpoint.from_directory({text!r}): not a local directory; write the checkpoint's files "
                "into a local directory (e.g. tempfile.TemporaryDirectory()) and pass that"
            )
        return cls(path=os.path.abspath(text))

    def to_directory(
        self, path: str | os.PathLike[str] | None = None, *, storage_options: Mapping[str, Any] | None = None
    ) -> str:
        """A local directory with the checkpoint's files: the checkpoint itself when it is local
        and no ``path`` is given, else a copy in ``path`` (default: a new temporary directory,
        which the caller removes).

        ``storage_options``: fsspec's options for remote storage; default: the run's, while this
        process holds them, else ``SPARK_TORCH_STORAGE_OPTIONS`` (the pickling rule:
        :mod:`~spark_torch.reporting.storage_keys`).

        Raises:
            ConfigurationError: the run used storage options, and none are given or known in
                this process (nothing was downloaded).
        """
        local = not _is_remote(self.path)
        if local and path is None:
            return self.path
        options = (
            {} if local else resolve_options(self.storage_key, storage_options, self.path, "checkpoint.to_directory")
        )
        return self._fetch(path, options)

    def _fetch(self, path: str | os.PathLike[str] | None, options: dict[str, Any]) -> str:
        """The checkpoint's files copied or downloaded (with ``options``) into ``path``."""
        target = (
            os.fspath(path) if path is not None else tempfile.mkdtemp(prefix=f"spark-torch-checkpoint-{self.step}-")
        )
        if not _is_remote(self.path):
            shutil.copytree(self.path, target, dirs_exist_ok=True)
            return target
        from fsspec.core import url_to_fs

        with options_withheld(options):
            fs, root = url_to_fs(self.path, **options)
            fs.get(root.rstrip("/") + "/", target.rstrip("/") + "/", recursive=True)
        return target

    @contextlib.contextmanager
    def as_directory(self, *, storage_options: Mapping[str, Any] | None = None) -> Iterator[str]:
        """``with checkpoint.as_directory() as d:`` a local directory with the checkpoint's files
        (Ray Train's ``as_directory``): the checkpoint itself when it is local (nothing is
        copied; do not change it), else a temporary download removed when the block ends
        (``storage_options`` as in :meth:`to_directory`).

        Raises:
            ConfigurationError: as :meth:`to_directory`.
        """
        if not _is_remote(self.path):
            yield self.path
            return
        options = resolve_options(self.storage_key, storage_options, self.path, "checkpoint.as_directory")
        target = tempfile.mkdtemp(prefix=f"spark-torch-checkpoint-{self.step}-")
        try:
            yield self._fetch(target, options)
        finally:
            shutil.rmtree(target, ignore_errors=True)


def persisted_checkpoint(info: CheckpointInfo, key: StorageKey | None) -> Checkpoint:
    """The :class:`Checkpoint` of a run's persisted checkpoint ``info`` (read from its storage,
    whose options ``key`` stands for: :func:`~spark_torch.reporting.storage_keys.remember`)."""
    return Checkpoint(path=info.url, step=info.step, metrics=dict(info.metrics), storage_key=key)
