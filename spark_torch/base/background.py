"""One call on a thread of its own, waited for with a deadline: a Spark job that blocks (the
barrier stage, the preflight probe) or a barrier ``allGather`` that may never return.

:class:`BackgroundCall` runs the call on a daemon thread and keeps what it returned or raised
(any ``BaseException``: the waiting thread decides what it means). :meth:`BackgroundCall.wait`
waits until it ended or a deadline passed; ``on_done`` runs when it ended, from its thread (to
wake a waiter that also waits for something else). Cancelling is the caller's: a Spark job is
cancelled by its tag, and the call then ends by itself.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["BackgroundCall"]

T = TypeVar("T")

_PENDING = object()


class BackgroundCall(Generic[T]):
    """``call()`` on a daemon thread named ``name`` (see the module docstring)."""

    def __init__(self, call: Callable[[], T], name: str, on_done: Callable[[], None] | None = None) -> None:
        self._call = call
        self._on_done = on_done
        self._value: object = _PENDING
        self._error: BaseException | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> BackgroundCall[T]:
        """Start the call; returns this object."""
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            self._value = self._call()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            self._error = exc
        finally:
            self._done.set()
            if self._on_done is not None:
                self._on_done()

    def wait(self, timeout: float | None) -> bool:
        """Whether the call ended within ``timeout`` seconds (None: without a deadline)."""
        return self._done.wait(timeout)

    @property
    def done(self) -> bool:
        """Whether the call ended (returned or raised)."""
        return self._done.is_set()

    @property
    def error(self) -> BaseException | None:
        """What the call raised (None while it runs or when it returned)."""
        return self._error if self._done.is_set() else None

    @property
    def value(self) -> T | None:
        """What the call returned (None while it runs or when it raised)."""
        if not self._done.is_set() or self._value is _PENDING:
            return None
        return self._value  # type: ignore[return-value]
