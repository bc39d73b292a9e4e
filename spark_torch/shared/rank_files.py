"""What is inside the files between a node runner and its ranks: the payload in, the result or error out.

Where each file is (and who writes and reads it) is :class:`spark_torch.shared.workdir_files.WorkdirFiles`;
this module is their formats and how they are written. The payload (``(fn, args, kwargs)``,
cloudpickled once on the driver by :mod:`spark_torch.driver.run.payload`) is a file the node
runner writes into its 0700 scratch directory; a rank writes its return value (rank 0) or its
exception there, atomically (temp file + rename, mode 0600). Bytes are only ever unpickled when they came from a file
this run wrote,
from frames authenticated with the run's secret, or through Spark's own task/result channel.
"""

from __future__ import annotations

import base64
import builtins
import json
import mmap
import os
import shutil
import tempfile
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO, Any

import cloudpickle

from spark_torch.errors import RankFailure
from spark_torch.shared.workdir_files import WorkdirFiles

__all__ = [
    "load_function_payload",
    "atomic_file",
    "write_atomic",
    "map_file",
    "ResultBytes",
    "write_result",
    "write_error",
    "RankError",
    "read_rank_error",
    "rebuild_exception",
]

CHUNK_SIZE = 16 * 1024 * 1024


def load_function_payload(data: bytes) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    """Inverse of :func:`spark_torch.driver.run.payload.dump_function_payload` (on the rank)."""
    fn, args, kwargs = cloudpickle.loads(data)
    return fn, tuple(args), dict(kwargs)


@contextmanager
def atomic_file(path: str) -> Iterator[IO[bytes]]:
    """A binary file that appears at ``path`` complete, or not at all (on any exception)."""
    directory = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as fh:
            yield fh
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def write_atomic(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` so readers see either nothing or the whole file."""
    with atomic_file(path) as fh:
        fh.write(data)


def write_atomic_from(path: str, source: IO[bytes]) -> None:
    """Like :func:`write_atomic`, copying from the open binary file ``source``."""
    with atomic_file(path) as fh:
        shutil.copyfileobj(source, fh, CHUNK_SIZE)


#: rank 0's pickled result as the driver holds it before unpickling
ResultBytes = bytes | bytearray | mmap.mmap


def map_file(path: str) -> bytes | mmap.mmap:
    """The file's bytes without reading them into a new buffer (a read-only memory map).

    The mapping stays valid after the file is deleted; ``pickle.loads`` reads it directly.
    """
    with open(path, "rb") as fh:
        if os.fstat(fh.fileno()).st_size == 0:
            return b""
        return mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)


def write_result(result_dir: str, rank: int, value: Any) -> None:
    """Rank side: pickle the return value straight into its file and publish it atomically.

    Large buffers (bytes, arrays, tensors' storage) go from the object to the file without an
    intermediate copy of the whole pickle.
    """
    with atomic_file(WorkdirFiles(result_dir).result(rank)) as fh:
        cloudpickle.dump(value, fh)


def write_error(result_dir: str, rank: int, exc: BaseException) -> None:
    """Rank side: publish the exception as text (and as a pickle, when it pickles)."""
    try:
        pickled: str | None = base64.b64encode(cloudpickle.dumps(exc)).decode("ascii")
    except Exception:  # noqa: BLE001 - the text is enough
        pickled = None
    report = {
        "exc_type": type(exc).__qualname__
        if type(exc).__module__ == "builtins"
        else f"{type(exc).__module__}.{type(exc).__qualname__}",
        "exc_message": str(exc),
        "traceback": "".join(traceback.format_exception(exc)),
        "pickled": pickled,
        # when it happened, as the rank saw it: orders a root cause before the failures it
        # caused on other ranks more precisely than when each node noticed a process exit
        "time": time.time(),
    }
    write_atomic(WorkdirFiles(result_dir).error(rank), json.dumps(report).encode("utf-8"))


@dataclass(frozen=True)
class RankError:
    """What a failed rank said about its error: the one typed reading of its error file (or of
    the file torch's ``@record`` wrote). Text only, except ``pickled``."""

    exc_type: str | None = None
    exc_message: str | None = None
    traceback: str | None = None
    #: the base64 pickle of the exception, when it pickled (only the rank's own file has one)
    pickled: str | None = None
    #: when it happened, as the rank saw it (None: unknown)
    time: float | None = None


def _text(data: dict[str, Any], key: str) -> str | None:
    value = data.get(key)
    return value if isinstance(value, str) else None


def read_rank_error(workdir: str, rank: int) -> RankError | None:
    """Node side: the error a rank wrote (:func:`write_error`), else the one torch's ``@record``
    wrote (its ``TORCHELASTIC_ERROR_FILE``), else None."""
    files = WorkdirFiles(workdir)
    data = _read_own_error(files.error(rank)) or _read_elastic_error(files.elastic_error(rank))
    if data is None:
        return None
    when = data.get("time")
    return RankError(
        exc_type=_text(data, "exc_type"),
        exc_message=_text(data, "exc_message"),
        traceback=_text(data, "traceback"),
        pickled=_text(data, "pickled"),
        time=float(when) if isinstance(when, (int, float)) and not isinstance(when, bool) else None,
    )


def _read_own_error(path: str) -> dict[str, Any] | None:
    try:
        with open(path, "rb") as fh:
            data = json.loads(fh.read().decode("utf-8"))
    except (FileNotFoundError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _read_elastic_error(path: str) -> dict[str, Any] | None:
    """The error ``torch.distributed.elastic.multiprocessing.errors.record`` wrote, as
    ``exc_type``/``exc_message``/``traceback`` (text only), or None."""
    try:
        with open(path, "rb") as fh:
            data = json.loads(fh.read().decode("utf-8"))
    except (OSError, ValueError):
        return None
    message = data.get("message") if isinstance(data, dict) else None
    if isinstance(message, str):
        message = {"message": message}
    if not isinstance(message, dict):
        return None
    text = str(message.get("message") or "")
    exc_type, sep, exc_message = text.partition(": ")
    extra = message.get("extraInfo")
    if not isinstance(extra, dict):
        extra = {}
    return {
        "exc_type": exc_type if sep else None,
        "exc_message": exc_message if sep else text,
        "traceback": str(extra.get("py_callstack") or "") or None,
    }


def rebuild_exception(failure: RankFailure, pickled: str | None) -> BaseException | None:
    """The rank's original exception: unpickled from a trusted file, or a builtin rebuilt from text."""
    if pickled:
        try:
            exc = cloudpickle.loads(base64.b64decode(pickled))
            if isinstance(exc, BaseException):
                return exc
        except Exception:  # noqa: BLE001 - fall back to the text
            pass
    cls = getattr(builtins, failure.exc_type or "", None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        try:
            return cls(failure.exc_message or "")
        except Exception:  # noqa: BLE001
            return None
    return None
