"""How a rank process ends: what Python's own shutdown does that users rely on, then a fast exit.

A normal interpreter exit, in order: wait for non-daemon threads (``threading._shutdown``,
which also joins ``concurrent.futures`` workers), run ``atexit`` handlers, flush the standard
streams, then tear everything down, which flushes and closes every file object still open.
That teardown costs about a second with torch imported (measured 1.0-1.7 s vs 0.1 s on 2
cores) and can abort the process once a gloo group existed ("terminate called without an
active exception"). :func:`finish` does the steps users rely on (a background upload thread
finishes, a file written without ``close()`` keeps its data, atexit runs) and then leaves with
``os._exit``, skipping only module and GC teardown.
"""

from __future__ import annotations

import atexit
import fcntl
import gc
import io
import os
import stat
import sys
import threading
from typing import Any, NoReturn

from spark_torch.base import envnames

__all__ = ["finish", "line_buffered_output", "destroy_process_group", "flush_open_files", "own_descriptor"]

#: descriptors spark_torch keeps open for writing in a rank and flushes itself (the stall
#: sampler's dump file): they alone never call for the scan of :func:`flush_open_files`
_own_fds: set[int] = set()


def own_descriptor(fd: int) -> None:
    """Mark ``fd`` as spark_torch's own, flushed by its owner (see :func:`flush_open_files`)."""
    _own_fds.add(fd)


def _may_hold_unwritten_data() -> bool:
    """Whether a file object could hold data not yet written: a descriptor other than the
    standard streams (flushed by :func:`finish`), the report pipes and :data:`_own_fds` is open
    for writing on a file, a pipe or a socket. True where ``/proc`` cannot tell."""
    skip = {0, 1, 2, *_own_fds}
    skip.update(int(fd) for fd in os.environ.get(envnames.REPORT_FDS, "").split(",") if fd.isdigit())
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return True
    for name in names:
        fd = int(name)
        if fd in skip:
            continue
        try:
            mode = os.fstat(fd).st_mode
            flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        except OSError:  # the listing's own descriptor, closed again
            continue
        kind = stat.S_ISREG(mode) or stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)
        if kind and flags & os.O_ACCMODE in (os.O_WRONLY, os.O_RDWR):
            return True
    return False


def destroy_process_group() -> None:
    """Tear down a process group the user's code left open (best effort).

    Exiting with a live gloo group can abort the interpreter ("terminate called without an
    active exception"), which would turn a successful rank into a SIGABRT.
    """
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return
    try:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - best effort at exit
        pass


def line_buffered_output() -> None:
    """Send each complete line at once, as a terminal would (the ranks write into pipes).

    Unbuffered output (``PYTHONUNBUFFERED=1``, which the ranks' child processes inherit) does one
    write per ``print`` argument and newline: two system calls per line. Line buffering
    without write-through does one per line and still shows every line live.
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(line_buffering=True, write_through=False)  # type: ignore[union-attr]
        except (AttributeError, ValueError):  # replaced or closed by a sitecustomize: leave it
            pass


def flush_open_files() -> int:
    """Flush and close every open file object except the standard streams, as interpreter
    teardown would; returns how many were closed. The scan of every object costs 100-150 ms
    with torch imported (170,000 objects), so it is made only when a descriptor that such a file
    could write to is open (:func:`_may_hold_unwritten_data`; a file object of the user's on
    descriptor 1 or 2 itself, other than ``sys.stdout``/``sys.stderr``, is not looked for).

    Text files first: a text file keeps its own buffer on top of its binary one, and closing
    the binary one first would drop what only the text layer held.
    """
    if not _may_hold_unwritten_data():
        return 0
    keep = {id(s) for s in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__, sys.stdin, sys.__stdin__)}
    text: list[Any] = []
    binary: list[Any] = []
    for obj in gc.get_objects():
        # issubclass on type(): isinstance would also ask obj.__class__, which some lazy
        # module attributes answer with a warning (torch.distributed.reduce_op)
        kind = type(obj)
        if id(obj) in keep:
            continue
        if issubclass(kind, io.TextIOWrapper):
            text.append(obj)
        elif issubclass(kind, (io.BufferedWriter, io.BufferedRandom)):
            binary.append(obj)
    closed = 0
    for file in text + binary:
        try:
            if not file.closed:
                file.close()  # flushes first
                closed += 1
        except Exception:  # noqa: BLE001 - like teardown: a failing close does not stop the others
            pass
    return closed


def finish(code: int) -> NoReturn:
    """Python's shutdown steps users rely on, then ``os._exit(code)``."""
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # joins non-daemon threads and executors
    except BaseException:  # noqa: BLE001 - e.g. Ctrl-C while waiting: go on with the rest
        pass
    try:
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001 - atexit reports its handlers' errors itself
        pass
    flush_open_files()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream must not turn success into failure
            pass
    os._exit(code)
