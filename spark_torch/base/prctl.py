"""Linux's ``prctl(2)``, the one way the node and rank processes set what the kernel does for them:
die with a parent (``PR_SET_PDEATHSIG``), adopt orphans (child subreaper), name a thread. Every call
answers False where there is no such call (not Linux, an old kernel) instead of raising: callers fall
back to the cleanup they have without it. Imports only the standard library (ranks import it first).
"""

from __future__ import annotations

import ctypes
import signal
from typing import Any

__all__ = [
    "prctl",
    "die_with_parent_thread",
    "become_subreaper",
    "is_subreaper",
    "PR_SET_PDEATHSIG",
    "PR_SET_NAME",
    "PR_SET_CHILD_SUBREAPER",
    "PR_GET_CHILD_SUBREAPER",
]

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15
PR_SET_CHILD_SUBREAPER = 36
PR_GET_CHILD_SUBREAPER = 37


def prctl(option: int, arg: Any) -> bool:
    """``prctl(option, arg, 0, 0, 0)`` succeeded (False where there is no such call)."""
    try:
        return int(ctypes.CDLL(None, use_errno=True).prctl(option, arg, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def die_with_parent_thread(sig: int = signal.SIGKILL) -> bool:
    """Get ``sig`` when the thread that started this process ends (False: not possible here)."""
    return prctl(PR_SET_PDEATHSIG, sig)


def become_subreaper() -> bool:
    """Mark this process a child subreaper: orphans below it are re-parented to it, not to init."""
    return prctl(PR_SET_CHILD_SUBREAPER, 1)


def is_subreaper() -> bool:
    """This process is a child subreaper (False where that cannot be asked)."""
    flag = ctypes.c_int(0)
    return prctl(PR_GET_CHILD_SUBREAPER, ctypes.byref(flag)) and flag.value != 0
