"""A compact live status of a run (ranks started / running / finished / failed, elapsed).

Rendered with tqdm on the driver's ``sys.stderr`` (a text bar that works in a terminal and in
Jupyter); log lines are written around it (the bar is cleared, the line written, the bar
redrawn) so they never garble each other. At the end the bar collapses into one summary line.
By default it is shown only when output is interactive (a terminal, or a Jupyter kernel).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

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


class RunStatus:
    """Counts rank states for one run and renders them (when ``enabled``)."""

    def __init__(self, world_size: int, enabled: bool) -> None:
        self.world_size = world_size
        self.enabled = enabled
        self.started = 0
        self.finished = 0
        self.failed = 0
        #: the latest reported metrics, shown after the counts
        self.latest = ""
        self._start = time.monotonic()
        self._lock = threading.RLock()
        self._bar: Any = None
        if enabled:
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
            self._render()

    @property
    def running(self) -> int:
        """Ranks started and not yet exited."""
        return self.started - self.finished - self.failed

    def _render(self) -> None:
        if self._bar is not None:
            self._bar.set_postfix_str(
                f"{self.started}/{self.world_size} started, {self.running} running, "
                f"{self.finished} finished, {self.failed} failed{self.latest}",
                refresh=True,
            )

    def metrics(self, row: dict[str, Any]) -> None:
        """A persisted report() step: show its step and first few metrics."""
        shown = [
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
            for k, v in row.items()
            if k not in ("step", "time", "attempt")
        ][:4]
        with self._lock:
            self.latest = f" | step {row.get('step')}: " + ", ".join(shown)
            self._render()

    def event(self, rank: int, state: str) -> None:
        """A rank ``started``, ``finished`` or ``failed``."""
        with self._lock:
            if state == "started":
                self.started += 1
            elif state == "finished":
                self.finished += 1
            elif state == "failed":
                self.failed += 1
            self._render()

    @contextmanager
    def around_output(self) -> Iterator[None]:
        """Clear the bar while log lines are written, then redraw it."""
        with self._lock:
            if self._bar is None:
                yield
                return
            self._bar.clear()
            try:
                yield
            finally:
                self._bar.refresh()

    def summary(self) -> str:
        """One line: how the ranks ended and how long the run took."""
        return (
            f"spark_torch: {self.world_size} rank(s): {self.finished} finished, {self.failed} failed, "
            f"{max(0, self.world_size - self.finished - self.failed)} stopped or not started, "
            f"in {time.monotonic() - self._start:.1f}s{self.latest.replace(' | ', '; last ', 1)}"
        )

    def close(self) -> None:
        """Remove the bar and, when shown, leave the summary line instead."""
        with self._lock:
            if self._bar is None:
                return
            self._bar.close()
            self._bar = None
            sys.stderr.write(self.summary() + "\n")
            sys.stderr.flush()
