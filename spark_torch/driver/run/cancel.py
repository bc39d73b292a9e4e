"""Stopping a run's attempts from another thread (:class:`Cancellation`).

Replica groups run each group's ``execute()`` in a thread of its own. When one group fails the
run, or the user interrupts it, the other groups' attempts must stop at once, whatever their
ranks are doing: a rank that never calls into torchft again (hung in its data loading, say) would
otherwise run until the run's ``timeout``, or for ever without one. An attempt registers what
stops it while it runs (:meth:`Cancellation.watch`: the local attempt's stop of its ranks, the
barrier stage's wake-up); :meth:`Cancellation.cancel` calls each once, and one registered later
at once. The attempt then ends as interrupted, with the error given to :meth:`~Cancellation.cancel`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["Cancellation", "RunCancelled"]


class RunCancelled(Exception):
    """A run stopped from outside, not by the user (another replica group failed the run); the
    run's outcome is "failed" with this message."""


class Cancellation:
    """Cancels the attempts that watch it, from any thread (once; later calls do nothing)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stops: dict[int, Callable[[], None]] = {}
        self._next = 0
        self._error: BaseException | None = None

    @property
    def error(self) -> BaseException | None:
        """What a cancelled attempt ends with (None: not cancelled)."""
        return self._error

    def cancel(self, error: BaseException) -> None:
        """Stop every watching attempt; each ends with ``error`` (a ``KeyboardInterrupt`` for
        Ctrl-C, a :class:`RunCancelled` saying why otherwise)."""
        with self._lock:
            if self._error is not None:
                return
            self._error = error
            stops = list(self._stops.values())
        for stop in stops:
            stop()

    @contextmanager
    def watch(self, stop: Callable[[], None]) -> Iterator[None]:
        """While the block runs, :meth:`cancel` calls ``stop`` (at once if it was cancelled already)."""
        with self._lock:
            key, self._next = self._next, self._next + 1
            self._stops[key] = stop
            cancelled = self._error is not None
        if cancelled:
            stop()
        try:
            yield
        finally:
            with self._lock:
                self._stops.pop(key, None)
