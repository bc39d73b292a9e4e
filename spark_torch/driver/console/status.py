"""A compact live status of a run (ranks started / running / finished / failed / stopped, elapsed).

In a terminal it is a tqdm line on the driver's ``sys.stderr``; log lines are written around it
(the line is cleared, the log written, the line redrawn) so they never garble each other. In
Jupyter it is one output updated in place (``display_id``: any frontend, no widgets needed, and
a stored notebook keeps only its last state). At the end it becomes one summary line, after
the ranks' lines (in Jupyter: the live output is emptied and the summary printed below). By
default it is shown only when output is interactive (a terminal, or a Jupyter kernel).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from spark_torch.base.states import RankState
from spark_torch.reporting.api import RECORDED_KEYS

__all__ = ["RunStatus", "interactive", "in_jupyter"]


def in_jupyter() -> bool:
    """True inside a running Jupyter kernel (merely importing ipykernel does not count)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None and hasattr(ipython, "get_ipython") else None
    return shell is not None and getattr(shell, "kernel", None) is not None


def interactive() -> bool:
    """True in a terminal or a Jupyter kernel; False in pipes, CI logs and test capture."""
    if in_jupyter():
        return True
    try:
        return bool(sys.stderr.isatty())
    except (AttributeError, ValueError):
        return False


class _Terminal:
    """A tqdm line on stderr."""

    def __init__(self, world_size: int) -> None:
        from tqdm import tqdm

        self._bar = tqdm(
            total=world_size,
            desc="spark_torch ranks",
            unit="rank",
            file=sys.stderr,
            leave=False,
            dynamic_ncols=True,
            bar_format="{desc}: {postfix} [{elapsed}]",
        )

    def show(self, text: str) -> None:
        self._bar.set_postfix_str(text, refresh=True)

    def clear(self) -> None:
        self._bar.clear()

    def redraw(self) -> None:
        self._bar.refresh()

    def close(self, summary: str) -> None:
        self._bar.close()
        sys.stderr.write(summary + "\n")
        sys.stderr.flush()


class _Notebook:
    """One output of the cell, updated in place."""

    def __init__(self) -> None:
        from IPython.display import display

        self._handle: Any = display({"text/plain": "spark_torch ranks: starting"}, raw=True, display_id=True)

    def show(self, text: str) -> None:
        self._handle.update({"text/plain": f"spark_torch ranks: {text}"}, raw=True)

    def clear(self) -> None:
        """Nothing to clear: log lines are printed below the status."""

    def redraw(self) -> None:
        """See :meth:`clear`."""

    def close(self, summary: str) -> None:
        """The live output emptied and the summary a new output: below the rank lines it sums up
        (the live output sits above them, where the run started). The ranks' lines still
        buffered in the cell's streams go out first."""
        from IPython.display import display

        for out in (sys.stdout, sys.stderr):
            out.flush()
        self._handle.update({"text/plain": ""}, raw=True)
        display({"text/plain": summary}, raw=True)


class RunStatus:
    """Counts rank states for one attempt and renders them (when ``enabled``)."""

    def __init__(self, world_size: int, enabled: bool) -> None:
        self.world_size = world_size
        self.enabled = enabled
        self.started = 0
        self.finished = 0
        self.failed = 0
        self.stopped = 0
        #: the latest reported metrics, shown after the counts
        self.latest = ""
        #: " | STALLED 62s" while no rank makes progress (stall detection)
        self.stall = ""
        self._start = time.monotonic()
        self._lock = threading.RLock()
        self._view: _Terminal | _Notebook | None = None
        if enabled:
            self._view = _Notebook() if in_jupyter() else _Terminal(world_size)
            self._render()

    @property
    def running(self) -> int:
        """Ranks started and not yet exited."""
        return self.started - self.finished - self.failed - self.stopped

    def _render(self) -> None:
        if self._view is not None:
            self._view.show(
                f"{self.started}/{self.world_size} started, {self.running} running, {self.finished} finished, "
                f"{self.failed} failed, {self.stopped} stopped{self.stall}{self.latest}"
            )

    def metrics(self, row: dict[str, Any]) -> None:
        """A persisted report() step: show its step and first few metrics."""
        shown = [
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items() if k not in RECORDED_KEYS
        ][:4]
        with self._lock:
            self.latest = f" | step {row.get('step')}: " + ", ".join(shown)
            self._render()

    def stalled(self, idle: float | None) -> None:
        """No rank made progress for ``idle`` seconds (None: the run moves again)."""
        with self._lock:
            self.stall = "" if idle is None else f" | STALLED: no progress for {idle:.0f}s"
            self._render()

    def event(self, rank: int, state: RankState) -> None:
        """A rank started, finished, failed or was stopped (by spark_torch: a timeout, Ctrl-C,
        another rank's failure)."""
        state = RankState(state)  # a state's value ("started") names it too
        with self._lock:
            if state is RankState.STARTED:
                self.started += 1
            elif state is RankState.FINISHED:
                self.finished += 1
            elif state is RankState.FAILED:
                self.failed += 1
            else:
                self.stopped += 1
            self._render()

    @contextmanager
    def around_output(self) -> Iterator[None]:
        """Clear the status line while log lines are written, then redraw it."""
        with self._lock:
            if self._view is None:
                yield
                return
            self._view.clear()
            try:
                yield
            finally:
                self._view.redraw()

    def summary(self) -> str:
        """One line: how the ranks ended and how long the run took."""
        return (
            f"spark_torch: {self.world_size} rank(s): {self.finished} finished, {self.failed} failed, "
            f"{self.stopped} stopped, {max(0, self.world_size - self.started)} not started, "
            f"in {time.monotonic() - self._start:.1f}s{self.latest.replace(' | ', '; last ', 1)}"
        )

    def close(self) -> None:
        """Remove the live line and, when shown, leave the summary line instead."""
        with self._lock:
            if self._view is None:
                return
            view, self._view = self._view, None
            view.close(self.summary())
