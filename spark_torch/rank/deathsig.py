"""Rank side, first thing at start-up: die with the node runner (Linux ``PR_SET_PDEATHSIG``).

The node runner starts ranks without ``preexec_fn`` (Python code between ``fork`` and ``exec``
can deadlock a multi-threaded parent), so each rank arms the signal itself, then checks that its
parent is still the node runner (``SPARK_TORCH_PARENT_PID``): if the runner died in between, the
rank has been re-parented and exits at once. Imports only the standard library.
"""

from __future__ import annotations

import os

from spark_torch.base import envnames
from spark_torch.base.prctl import die_with_parent_thread

__all__ = ["die_with_parent"]

#: exit status of a rank whose node runner was already gone when it started (128 + SIGKILL)
ORPHAN_EXIT = 137


def die_with_parent() -> None:
    """Get SIGKILL when the thread that started this process dies; exit now if it already did."""
    expected = os.environ.get(envnames.PARENT_PID)
    if not die_with_parent_thread():  # not Linux: the node runner's and the reaper's cleanup apply
        return
    if expected and expected.isdigit() and os.getppid() != int(expected):
        os._exit(ORPHAN_EXIT)
