"""Payloads (driver -> ranks), result/error envelopes (rank -> node runner) and chunking.

Bytes are only ever unpickled when they came from a file this run wrote or through Spark's
own task/result channel, never from a socket of ours.
"""

from __future__ import annotations

import base64
import builtins
import inspect
import json
import mmap
import os
import shutil
import sys
import sysconfig
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import IO, Any

import cloudpickle

from spark_torch.driver.entrypoint import FunctionEntrypoint
from spark_torch.errors import PicklingError, RankFailure

__all__ = [
    "dump_function_payload",
    "load_function_payload",
    "atomic_file",
    "write_atomic",
    "map_file",
    "ResultBytes",
    "result_path",
    "error_path",
    "write_result",
    "write_error",
    "read_error",
    "elastic_error_path",
    "read_elastic_error",
    "rebuild_exception",
]

CHUNK_SIZE = 16 * 1024 * 1024


def _installed_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    roots = {paths.get(k, "") for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    return tuple(os.path.realpath(r) + os.sep for r in roots if r)


def _modules_to_ship_by_value(obj: Any) -> list[ModuleType]:
    """User modules (not installed in site-packages/stdlib) that ``obj`` refers to.

    Executors usually cannot import them (they live in a notebook's folder or a repo on the
    driver), so they are pickled by value, like ``__main__``.
    """
    roots = _installed_roots()
    found: dict[str, ModuleType] = {}

    def consider(value: Any) -> None:
        module_name = getattr(value, "__module__", None) if not isinstance(value, ModuleType) else value.__name__
        if not module_name or module_name == "__main__" or module_name in found:
            return
        top = module_name.split(".")[0]
        if top in sys.builtin_module_names or top in ("spark_torch", "cloudpickle", "pyspark", "torch"):
            return
        module = sys.modules.get(module_name)
        file = getattr(module, "__file__", None)
        if module is None or not file:
            return
        if os.path.realpath(file).startswith(roots):
            return
        found[module_name] = module

    values = [obj]
    if inspect.isfunction(obj):
        closure = inspect.getclosurevars(obj)
        values += list(closure.globals.values()) + list(closure.nonlocals.values())
    for value in values:
        consider(value)
        if not isinstance(value, ModuleType):
            consider(type(value))
    return list(found.values())


#: cloudpickle's by-value registry is process-global: one payload is pickled at a time, so that
#: one run() unregistering a module cannot change how another run() pickles it
_PICKLE_LOCK = threading.Lock()


@contextmanager
def _by_value(modules: list[ModuleType]) -> Iterator[None]:
    registered = []
    try:
        for module in modules:
            try:
                cloudpickle.register_pickle_by_value(module)
                registered.append(module)
            except ValueError:
                pass
        yield
    finally:
        for module in registered:
            cloudpickle.unregister_pickle_by_value(module)


def _find_culprit(entry: FunctionEntrypoint) -> str | None:
    """Name the argument, global or closure variable that does not pickle."""
    candidates: list[tuple[str, Any]] = []
    for i, arg in enumerate(entry.args):
        candidates.append((f"positional argument {i}", arg))
    for key, arg in entry.kwargs.items():
        candidates.append((f"keyword argument {key!r}", arg))
    if inspect.isfunction(entry.fn):
        closure = inspect.getclosurevars(entry.fn)
        for key, value in closure.nonlocals.items():
            candidates.append((f"closure variable {key!r}", value))
        for key, value in closure.globals.items():
            if not isinstance(value, ModuleType):
                candidates.append((f"global {key!r}", value))
    for label, value in candidates:
        try:
            cloudpickle.dumps(value)
        except Exception as exc:  # noqa: BLE001 - any failure names the culprit
            return f"{label} ({type(value).__name__}: {exc})"
    return None


def dump_function_payload(entry: FunctionEntrypoint) -> bytes:
    """Cloudpickle ``(fn, args, kwargs)`` once, shipping user modules by value.

    Raises :class:`PicklingError` naming the object that failed.
    """
    modules = _modules_to_ship_by_value(entry.fn)
    with _PICKLE_LOCK, _by_value(modules):
        try:
            data: bytes = cloudpickle.dumps((entry.fn, entry.args, entry.kwargs))
            return data
        except Exception as exc:  # noqa: BLE001 - every pickling failure gets the same advice
            culprit = _find_culprit(entry) or f"the function itself ({exc})"
            raise PicklingError(
                f"cannot send {entry.description}() to the ranks: {culprit} cannot be pickled. "
                "Objects such as locks, open files, sockets, SparkSession/SparkContext and "
                "DataFrames cannot cross processes; create them inside the function, or pass "
                "what they hold (paths, numbers, arrays) instead"
            ) from exc


def load_function_payload(data: bytes) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    """Inverse of :func:`dump_function_payload` (on the rank)."""
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


def result_path(result_dir: str, rank: int) -> str:
    """Where a rank writes its pickled return value."""
    return os.path.join(result_dir, f"rank-{rank}.result")


def error_path(result_dir: str, rank: int) -> str:
    """Where a rank writes its error report (JSON)."""
    return os.path.join(result_dir, f"rank-{rank}.error.json")


def write_result(result_dir: str, rank: int, value: Any) -> None:
    """Rank side: pickle the return value straight into its file and publish it atomically.

    Large buffers (bytes, arrays, tensors' storage) go from the object to the file without an
    intermediate copy of the whole pickle.
    """
    with atomic_file(result_path(result_dir, rank)) as fh:
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
    write_atomic(error_path(result_dir, rank), json.dumps(report).encode("utf-8"))


def read_error(result_dir: str, rank: int) -> dict[str, Any] | None:
    """Node side: the error report a rank wrote, if any."""
    try:
        with open(error_path(result_dir, rank), "rb") as fh:
            data = json.loads(fh.read().decode("utf-8"))
    except (FileNotFoundError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def elastic_error_path(result_dir: str, rank: int) -> str:
    """A rank's ``TORCHELASTIC_ERROR_FILE`` (what torch's ``@record`` writes on an exception)."""
    return os.path.join(result_dir, f"rank-{rank}.torchelastic-error.json")


def read_elastic_error(path: str) -> dict[str, Any] | None:
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
