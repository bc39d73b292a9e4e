"""What the warm-start template does with the processes re-parented to it.

The template is a child subreaper (``PR_SET_CHILD_SUBREAPER``): a process whose ancestors up to
the template all died is re-parented to the template, not to init. Its own children are the
ranks' keepers and the store hosts it forked, each listed; a keeper keeps whatever the rank
leaves and stops it when the rank ends (:mod:`spark_torch.node.keeper`). Only a keeper that
died without doing so (SIGKILL, the one signal it cannot ignore; its rank dies with it) hands
its rank and the rank's orphans on, to the template: any child the template did not fork is
such an orphan. Only a subreaper has orphans: a process that is not one (a template's loop run
inside another program, as a test does) has only children it or its host started, and sweeps
none. :class:`Adopted` SIGKILLs each one with its whole tree (the rank it belonged to
was killed the same way) and reaps it, on the template's own loop: no thread, no blocking wait.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Container

import psutil

from spark_torch.base.prctl import is_subreaper

__all__ = ["Adopted"]


class Adopted:
    """The orphans re-parented to this process, SIGKILLed with their trees until reaped."""

    def __init__(self) -> None:
        #: killed children not yet reaped
        self.pids: set[int] = set()

    @property
    def pending(self) -> bool:
        """Some were killed and are not reaped yet (look again soon)."""
        return bool(self.pids)

    def sweep(self, forked: Container[int]) -> None:
        """SIGKILL every child of this process that is not in ``forked`` (and all its
        descendants, found before the first signal), then reap those that have ended. Never
        raises: a process that ended meanwhile is simply gone. A process that is not a child
        subreaper adopts nothing: it sweeps none of its children (they are its host's: the
        Spark driver's JVM where a test runs the loop in its own process)."""
        if not is_subreaper():
            return
        try:
            children = psutil.Process().children()
        except psutil.Error:
            children = []
        for child in children:
            if child.pid in forked or child.pid in self.pids:
                continue
            with contextlib.suppress(psutil.Error):
                tree = [child, *child.children(recursive=True)]
                for proc in tree:  # the child is ours and unreaped: its pid cannot be reused
                    with contextlib.suppress(psutil.Error):
                        proc.kill()
            self.pids.add(child.pid)
        for pid in list(self.pids):
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done = pid
            if done:
                self.pids.discard(pid)
