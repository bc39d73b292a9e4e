"""A tiny watchdog that cleans up after a node runner that died without cleaning up.

``python -m spark_torch.node.reaper_main`` is started by the node runner in its own session
(so a kill of the runner's process group or Spark's SIGKILL of the Python worker spares it).
The runner first writes one JSON line on the reaper's stdin, ``{"workdir": ..., "marker":
{KEY: VALUE...}}`` (on stdin, not in argv: ``ps`` shows argv to every user of the host), then
one line per rank it starts, ``PGID CREATE_TIME`` (the
rank's process group and its leader's creation time), and ``done`` once it has cleaned up
itself. If stdin reaches EOF without ``done`` (the runner died), the reaper stops every rank's
process tree, and every process whose environment holds all KEY=VALUE items (the node's
marker, with this attempt's random token: orphans that left the rank's process group), with SIGTERM, a grace period,
SIGKILL,
never signalling a recycled pid (see :mod:`spark_torch.node.process_tree`); then it removes WORKDIR
and exits. It reads only its parent's pipe
and never imports torch or pyspark.
"""

from __future__ import annotations

import json
import shutil
import sys

from spark_torch.base.grace import RANK_GRACE_SECONDS
from spark_torch.node.process_tree import GroupRef, terminate_trees

__all__ = ["main", "parse_line"]

#: the node runner's own grace (the driver waits for that long: :mod:`spark_torch.base.grace`)


def parse_line(line: str) -> GroupRef | None:
    """``"PGID CREATE_TIME"`` -> a group reference; None for anything else."""
    parts = line.split()
    if len(parts) != 2 or not parts[0].isdigit():
        return None
    try:
        return int(parts[0]), float(parts[1])
    except ValueError:
        return None


def main(argv: list[str]) -> int:
    """Wait for the parent's pipe to close; clean up unless it said ``done``."""
    try:
        first = json.loads(sys.stdin.readline() or "{}")
        workdir = str(first["workdir"])
        marker = {str(k): str(v) for k, v in dict(first.get("marker") or {}).items()}
    except (ValueError, KeyError, TypeError):
        return 2  # not started by a node runner
    groups: list[GroupRef] = []
    last = ""
    for line in sys.stdin:
        last = line.strip()
        ref = parse_line(last)
        if ref is not None:
            groups.append(ref)
    if last == "done":
        return 0
    terminate_trees(groups, RANK_GRACE_SECONDS, marker=marker)
    shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
