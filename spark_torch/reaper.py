"""A tiny watchdog that cleans up after a node runner that died without cleaning up.

``python -m spark_torch.reaper WORKDIR`` is started by the node runner in its own session
(so a kill of the runner's process group or Spark's SIGKILL of the Python worker spares it).
The runner writes one process-group id per line on the reaper's stdin as it starts ranks, and
``done`` once it has cleaned up itself. If stdin reaches EOF without ``done`` (the runner
died), the reaper SIGTERMs every group, SIGKILLs them after a grace period, removes WORKDIR
and exits. It reads only its parent's pipe and never imports torch or pyspark.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time

__all__ = ["main"]

GRACE_SECONDS = 3.0


def _alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _signal(pgids: list[int], sig: int) -> None:
    for pgid in pgids:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def main(argv: list[str]) -> int:
    """Wait for the parent's pipe to close; clean up unless it said ``done``."""
    workdir = argv[0]
    pgids: list[int] = []
    last = ""
    for line in sys.stdin:
        last = line.strip()
        if last.isdigit():
            pgids.append(int(last))
    if last == "done":
        return 0
    _signal(pgids, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_SECONDS
    while any(_alive(p) for p in pgids) and time.monotonic() < deadline:
        time.sleep(0.05)
    _signal(pgids, signal.SIGKILL)
    shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
