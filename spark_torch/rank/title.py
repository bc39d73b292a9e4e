"""A rank's process title: what ``ps``, ``htop``, ``pgrep -f`` and psutil show for it, in both
modes and warm or cold (a warm rank was forked from the template, whose command line it keeps
otherwise): ``spark-torch rank 0: train.py --lr 0.1``, or ``spark-torch rank 0: train()``; a
replica group's rank names its group, ``spark-torch group 1 rank 0: train.py`` (every group has a
rank 0, and a warm rank's environment, where ``REPLICA_GROUP_ID`` is, cannot be read by psutil).

Linux only, without a dependency: the title is written over the process's own argument area
(what /proc/PID/cmdline reads; ``setproctitle``'s way, within the area's length, never into the
environment block after it: a warm rank has the room of the template's command line, about 100
characters, and a longer title is cut), and the name (``comm``, 15 bytes: ``pgrep train.py``, psutil's
``name()``) through ``prctl(PR_SET_NAME)``. A title that cannot be set leaves the process as it was.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys

from spark_torch.base.prctl import PR_SET_NAME, prctl

__all__ = ["set_title", "rank_title"]


def rank_title(rank: int | str, what: str, group: int | str | None = None) -> str:
    """The title of rank ``rank`` (of replica group ``group``, if any) running ``what`` (a script
    and its arguments, or ``name()``)."""
    return f"spark-torch rank {rank}: {what}" if group is None else f"spark-torch group {group} rank {rank}: {what}"


def _argument_area() -> tuple[int, int]:
    """Where this process's arguments are in its memory: (start, end), from /proc/self/stat."""
    with open("/proc/self/stat", "rb") as fh:
        fields = fh.read().rsplit(b")", 1)[1].split()  # from field 3 (state) on: comm may hold spaces
    return int(fields[48 - 3]), int(fields[49 - 3])  # fields 48, 49: arg_start, arg_end (Linux 3.5)


def set_title(title: str, name: str) -> bool:
    """Show ``title`` as this process's command line and ``name`` as its name; False where it
    cannot (not Linux, an old kernel)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        prctl(PR_SET_NAME, ctypes.c_char_p(name.encode("utf-8", "replace")[:15]))
        start, end = _argument_area()
    except (OSError, ValueError, IndexError, AttributeError):
        return False
    size = end - start
    if start <= 0 or size < 2:
        return False
    text = title.encode("utf-8", "replace")[: size - 2]
    # the title, one NUL, then spaces to the area's end: its last byte is not NUL, so the kernel
    # reads the command line up to the first NUL (the title alone), as it does for setproctitle
    data = text + b"\0" + b" " * (size - len(text) - 1)
    with contextlib.suppress(OSError, ValueError):
        ctypes.memmove(start, data, size)
        return True
    return False
