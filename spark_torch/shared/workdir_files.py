"""Every file a node and its ranks exchange, named once (the way submitit's ``JobPaths`` names a job's).

A node's scratch directory (:class:`spark_torch.node.workdir.NodeWorkdir`, mode 0700) is the
only place the node runner and its ranks hand files to each other. :class:`WorkdirFiles` is
built from that directory's path and has one method per file, saying who writes it and who
reads it; nothing else spells these names. Ranks learn the paths from their argv
(:data:`~spark_torch.node.rank_group.RANK_MAIN_MODULE` ``PAYLOAD WORKDIR``) or their
environment (``SPARK_TORCH_STORAGE``, ``SPARK_TORCH_STACK_FILE``, ``SPARK_TORCH_DATA_FILE``,
``SPARK_TORCH_CHECKPOINT``, ``TORCHELASTIC_ERROR_FILE``; names in :mod:`spark_torch.base.envnames`).

Files appear whole: the writer of each file writes a temporary file next to it and renames it
(:func:`spark_torch.shared.rank_files.write_atomic`, mode 0600). Every file of the folder is
created 0600 whatever the umask (Spark executors often run with umask 0): a writer that does not
go through ``write_atomic`` opens its file with :func:`open_private`. What is inside the payload, result and
error files is :mod:`spark_torch.shared.rank_files`; inside ``storage.json`` is :class:`StorageFile`.
A rank's stack file has companions named after it (:func:`trace_path` and the functions below
it), since a rank knows only its stack file's path.

Pure names and one small schema: imports neither pyspark nor torch, nor any layer.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, Any

from spark_torch.errors import LaunchError

if TYPE_CHECKING:
    from spark_torch.shared.spec import StorageSpec

__all__ = [
    "WorkdirFiles",
    "StorageFile",
    "trace_path",
    "trace_request_path",
    "native_dump_path",
    "child_stack_path",
    "child_stack_pattern",
    "open_private",
    "make_private",
]

#: ``open()`` modes :func:`open_private` takes, and how each opens the file
_PRIVATE_MODES = {
    "w": os.O_TRUNC,
    "wb": os.O_TRUNC,
    "a": os.O_APPEND,
    "ab": os.O_APPEND,
    "x": os.O_EXCL,
    "xb": os.O_EXCL,
}


def open_private(path: str, mode: str = "w", *, encoding: str | None = None) -> IO[Any]:
    """``open(path, mode)`` for writing (``mode``: ``w``, ``a`` or ``x``, text or ``b``), except
    that a file it creates is 0600 (never more, whatever the umask): how every file of a node's
    scratch folder that :func:`~spark_torch.shared.rank_files.write_atomic` does not write is
    opened, its temporary files included (a rank inherits its executor's umask, often 0)."""
    if mode not in _PRIVATE_MODES:
        raise ValueError(f"open_private takes the modes {sorted(_PRIVATE_MODES)}, not {mode!r}")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | _PRIVATE_MODES[mode], 0o600)
    try:
        return os.fdopen(fd, mode, encoding=None if "b" in mode else (encoding or "utf-8"))
    except BaseException:
        os.close(fd)
        raise


def make_private(path: str) -> None:
    """Folders 0700 and files 0600 under ``path`` (itself included; symbolic links are left
    alone): for what a library wrote into the scratch folder with its own modes (a resumed
    checkpoint fsspec downloaded)."""
    for root, _dirs, files in os.walk(path):
        os.chmod(root, 0o700)
        for name in files:
            full = os.path.join(root, name)
            if not os.path.islink(full):
                os.chmod(full, 0o600)


@dataclass(frozen=True)
class WorkdirFiles:
    """The files of one node's scratch directory ``path``, for its ranks and from them."""

    path: str

    # the node writes these for its ranks, before they start
    def payload(self) -> str:
        """The cloudpickled ``(fn, args, kwargs)`` (function mode). Node writes, a rank reads
        (argv of :mod:`spark_torch.rank.function_main`)."""
        return os.path.join(self.path, "payload.pkl")

    def storage(self) -> str:
        """How a rank opens the run's storage (:class:`StorageFile`): a 0600 file, since the
        storage options may hold credentials that must not be in a rank's environment. Node
        writes (only when the run has storage), a rank's ``report(checkpoint=...)`` reads
        (``SPARK_TORCH_STORAGE``)."""
        return os.path.join(self.path, "storage.json")

    def files_dir(self) -> str:
        """The folder of the run's files (``RunSpec.files``, script mode). Node makes it (0700)."""
        return os.path.join(self.path, "files")

    def file(self, name: str) -> str:
        """One file of ``RunSpec.files`` (its base name only: a name never leaves the folder).
        Node writes, the user's script reads (its argument ``file_argument(name)`` becomes this)."""
        return os.path.join(self.files_dir(), os.path.basename(name))

    def data(self) -> str:
        """This node's DataFrame rows, a folder of column files (``run_on_dataframe``,
        :mod:`spark_torch.shared.column_files`). Node writes (:mod:`spark_torch.node.staging`),
        :mod:`spark_torch.rank.data` reads (``SPARK_TORCH_DATA_FILE``)."""
        return os.path.join(self.path, "data")

    def checkpoint(self) -> str:
        """The folder a checkpoint on remote storage is downloaded into, when the attempt
        resumes from it. Node writes, ranks read (``SPARK_TORCH_CHECKPOINT``)."""
        return os.path.join(self.path, "checkpoint")

    # a rank writes these for its node
    def result(self, rank: int) -> str:
        """A rank's pickled return value (function mode; only rank 0's is kept). Rank writes,
        node 0 hands it to the driver (:mod:`spark_torch.node.result_transfer`)."""
        return os.path.join(self.path, f"rank-{rank}.result")

    def error(self, rank: int) -> str:
        """A rank's exception, as JSON (:func:`spark_torch.shared.rank_files.write_error`). Rank writes,
        node reads (:func:`spark_torch.shared.rank_files.read_rank_error`)."""
        return os.path.join(self.path, f"rank-{rank}.error.json")

    def elastic_error(self, rank: int) -> str:
        """A rank's ``TORCHELASTIC_ERROR_FILE``: torch's ``@record`` writes it (like under
        torchrun), node reads (:func:`spark_torch.shared.rank_files.read_rank_error`, when the rank wrote no error of
        its own)."""
        return os.path.join(self.path, f"rank-{rank}.torchelastic-error.json")

    def stack(self, rank: int) -> str:
        """Where a rank's sampler writes its main thread's stack (stall detection). Rank
        writes (:mod:`spark_torch.rank.sampler`), node reads (:mod:`spark_torch.node.progress`)
        (``SPARK_TORCH_STACK_FILE``; its companions: :func:`trace_path` and below)."""
        return os.path.join(self.path, f"stack-{rank}.json")

    # the driver's result directory (a driver-side workdir): rank 0's result comes in here
    def handed_over_result(self) -> str:
        """Rank 0's result, moved here by node 0 when it sees this directory. Node 0 writes,
        the driver reads (:mod:`spark_torch.node.result_transfer`)."""
        return self.result(0)

    def streamed_result(self) -> str:
        """Rank 0's result as node 0 streamed it over the channel. The driver writes and reads."""
        return os.path.join(self.path, "rank-0.streamed-result")

    def result_token(self) -> str:
        """The token that marks this directory as the run's (0600). The driver writes, node 0
        reads before it hands the result over."""
        return os.path.join(self.path, ".spark_torch_result_dir")


# a rank's stack file's companions (the rank knows only its stack file's path)
def trace_path(stack_file: str) -> str:
    """Where a rank writes its Flight Recorder trace when its node asks (a stall). Rank writes, node reads."""
    return stack_file + ".trace"


def trace_request_path(stack_file: str) -> str:
    """The file a node touches to ask its rank for that trace. Node writes, rank reads (and removes)."""
    return stack_file + ".trace-request"


def native_dump_path(stack_file: str) -> str:
    """Where faulthandler writes a rank's stacks when its node sends the dump signal. Rank
    writes, node reads (and truncates)."""
    return stack_file + ".native"


def child_stack_path(stack_file: str, pid: int) -> str:
    """Where a rank's forked child (a DataLoader worker) writes its stack. Child writes, node reads."""
    return f"{stack_file}.child-{pid}"


def child_stack_pattern(stack_file: str) -> str:
    """A glob pattern that matches every :func:`child_stack_path` of ``stack_file``."""
    return glob.escape(stack_file) + ".child-*"


@dataclass(frozen=True)
class StorageFile:
    """``storage.json``: the run's storage as a rank opens it (:meth:`WorkdirFiles.storage`).

    The JSON object has exactly these keys: ``base`` (a directory or an fsspec URL),
    ``run_id``, ``token`` (the marker a rank checks the storage by) and ``options`` (fsspec's
    keyword arguments: credentials, never printed, never in an error message).
    """

    base: str
    run_id: str
    token: str = field(default="", repr=False)
    options: Mapping[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, storage: StorageSpec, run_id: str) -> StorageFile:
        """What a node writes for the run's ``storage``."""
        return cls(base=storage.base, run_id=run_id, token=storage.token, options=dict(storage.options))

    def spec(self) -> StorageSpec:
        """The :class:`~spark_torch.shared.spec.StorageSpec` the rank opens (``required`` stays the node's business)."""
        from spark_torch.shared.spec import StorageSpec

        return StorageSpec(base=self.base, token=self.token, options=dict(self.options))

    def to_json(self) -> bytes:
        """The file's bytes (UTF-8 JSON)."""
        data = {"base": self.base, "run_id": self.run_id, "token": self.token, "options": dict(self.options)}
        return json.dumps(data).encode("utf-8")

    @classmethod
    def from_json(cls, data: bytes | str, where: str = "storage.json") -> StorageFile:
        """Parse and check the file's bytes; a :class:`~spark_torch.errors.LaunchError` naming
        ``where`` and the fault when they are not what a node writes (never quoting them)."""
        try:
            parsed = json.loads(data)
        except (ValueError, UnicodeDecodeError):
            raise LaunchError(f"{where} (the run's storage, written by the node runner) is not valid JSON") from None
        if not isinstance(parsed, dict):
            raise LaunchError(f"{where} (the run's storage) holds a {type(parsed).__name__}, not a JSON object")
        wrong = [key for key in ("base", "run_id", "token") if not isinstance(parsed.get(key), str)]
        options = parsed.get("options", {})
        if options is None:
            options = {}
        if not isinstance(options, dict):
            wrong.append("options")
        if wrong or not parsed["base"] or not parsed["run_id"]:
            fields = ", ".join(wrong) or "base or run_id (empty)"
            raise LaunchError(
                f"{where} (the run's storage) lacks or garbles {fields}: it is not what the node runner writes"
            )
        return cls(base=parsed["base"], run_id=parsed["run_id"], token=parsed["token"], options=options)

    @classmethod
    def read(cls, path: str) -> StorageFile:
        """Read and check the file at ``path`` (rank side); a :class:`~spark_torch.errors.LaunchError` when it
        cannot."""
        try:
            with open(path, "rb") as fh:
                data = fh.read()
        except OSError as exc:
            raise LaunchError(
                f"cannot read {path}, the run's storage as the node runner described it: "
                f"{exc.strerror or type(exc).__name__} (was the rank started outside its node runner?)"
            ) from None
        return cls.from_json(data, path)
