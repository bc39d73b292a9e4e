"""The function-mode payload: ``(fn, args, kwargs)`` cloudpickled once, on the driver.

User modules that executors cannot import (a notebook's folder, a repository on the driver) are
shipped by value; a payload that does not pickle fails here, before anything starts, naming the
argument, global or closure variable at fault. The rank side reads it with
:func:`spark_torch.shared.rank_files.load_function_payload`.
"""

from __future__ import annotations

import inspect
import io
import operator
import os
import sys
import sysconfig
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import CodeType, ModuleType
from typing import Any

import cloudpickle

from spark_torch.driver.run.entrypoint import FunctionEntrypoint
from spark_torch.errors import PicklingError

__all__ = ["dump_function_payload"]


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


#: what cloudpickle (3.1.3 and later) writes as every function's file name
_ANONYMOUS_FILE = "<dynamic-code>"


class _PayloadPickler(cloudpickle.Pickler):  # type: ignore[misc]  # cloudpickle ships no types
    """cloudpickle, keeping each function's source file name.

    cloudpickle replaces ``co_filename`` with ``<dynamic-code>`` to make payloads deterministic;
    a rank's traceback would then point nowhere. The payload is pickled once per run, so
    determinism buys nothing here and the user keeps ``File "train.py", line 12``.
    """

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, CodeType) and obj.co_filename != _ANONYMOUS_FILE:
            # pickle the code under cloudpickle's name, then give the file name back on load
            anonymous = obj.replace(co_filename=_ANONYMOUS_FILE)
            return operator.methodcaller("replace", co_filename=obj.co_filename), (anonymous,)
        return super().reducer_override(obj)


def _dumps(obj: Any) -> bytes:
    with io.BytesIO() as buffer:
        _PayloadPickler(buffer, protocol=cloudpickle.DEFAULT_PROTOCOL).dump(obj)
        return buffer.getvalue()


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
            data: bytes = _dumps((entry.fn, entry.args, entry.kwargs))
            return data
        except Exception as exc:  # noqa: BLE001 - every pickling failure gets the same advice
            culprit = _find_culprit(entry) or f"the function itself ({exc})"
            raise PicklingError(
                f"cannot send {entry.description}() to the ranks: {culprit} cannot be pickled. "
                "Objects such as locks, open files, sockets, SparkSession/SparkContext and "
                "DataFrames cannot cross processes; create them inside the function, or pass "
                "what they hold (paths, numbers, arrays) instead"
            ) from exc
