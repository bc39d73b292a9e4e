"""A node's scratch directory and the reaper that cleans up after a node runner that died.

The directory (mode 0700) holds the payload, the ranks' result and error files and the node's
data; it lives in the first usable Spark local dir (:func:`scratch_root`) and is removed when
the node ends. The reaper (:mod:`spark_torch.node.reaper_main`) is told every rank process group
started here and stops them, and removes the directory, if this process dies first.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping

from spark_torch.base import envnames
from spark_torch.node.processes import with_package_on_path

__all__ = ["NodeWorkdir", "node_marker", "scratch_root", "REAPER_MODULE"]

REAPER_MODULE = "spark_torch.node.reaper_main"


def node_marker(run_id: str, node_rank: int, token: str | None = None) -> dict[str, str]:
    """Environment items every rank of this node, and everything they start, inherits: how the
    node's processes are found even after they left the rank's process group. ``token`` (a
    fresh random one when None) is this node's for this attempt: a stop matches all three
    items, so it never reaches another run given the same run id, nor the next attempt."""
    return dict(zip(envnames.NODE_MARKER, (run_id, str(node_rank), token or secrets.token_hex(16))))


def _start_reaper(python: str, workdir: str, marker: Mapping[str, str]) -> subprocess.Popen[bytes] | None:
    """The watchdog that cleans up if this process dies before its own cleanup runs."""
    env = with_package_on_path({k: v for k, v in os.environ.items() if k not in envnames.SCRUBBED})
    try:
        reaper = subprocess.Popen(
            [python, "-m", REAPER_MODULE],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            close_fds=True,
            env=env,
        )
    except OSError:
        return None
    # where and what to clean up goes over the pipe: argv is visible to every user in ps
    _tell_reaper(reaper, json.dumps({"workdir": workdir, "marker": dict(marker)}))
    return reaper


def _tell_reaper(reaper: subprocess.Popen[bytes] | None, line: str) -> None:
    if reaper is None or reaper.stdin is None:
        return
    try:
        reaper.stdin.write(line.encode("ascii") + b"\n")
        reaper.stdin.flush()
    except (BrokenPipeError, ValueError):
        pass


def scratch_root(environ: Mapping[str, str] | None = None) -> str | None:
    """Where a node keeps its files: the first usable of Spark's local dirs (``SPARK_LOCAL_DIRS``,
    which Spark gives its Python workers; ``LOCAL_DIRS`` on YARN), else None (the temp dir).

    Spark's local dirs are the disks the cluster meant for scratch data, and Spark removes
    them with the executor; ``/tmp`` is often small or a RAM disk.
    """
    env = os.environ if environ is None else environ
    for var in ("SPARK_LOCAL_DIRS", "LOCAL_DIRS"):
        for directory in (env.get(var) or "").split(","):
            directory = directory.strip()
            if directory and os.path.isdir(directory) and os.access(directory, os.W_OK | os.X_OK):
                return directory
    return None


class NodeWorkdir:
    """A node's scratch dir (payload, results, data; mode 0700), guarded by a reaper; removed on exit."""

    def __init__(self, run_id: str, node_rank: int, python: str = sys.executable, *, role: str = "node") -> None:
        self.path = tempfile.mkdtemp(prefix=f"spark-torch-{run_id}-{role}{node_rank}-", dir=scratch_root())
        #: what every rank of this node (this attempt) carries in its environment (empty: the
        #: driver's result dir, which guards no ranks); its reaper finds the node's orphans by it
        self.marker: dict[str, str] = node_marker(run_id, node_rank) if role == "node" else {}
        self._reaper = _start_reaper(python, self.path, self.marker)

    @property
    def reaper_pid(self) -> int | None:
        """The pid of this workdir's reaper (None: it could not be started)."""
        return self._reaper.pid if self._reaper is not None else None

    def track(self, pgid: int, created: float) -> None:
        """Tell the reaper about a process group (and its leader's creation time) to stop if this process dies."""
        _tell_reaper(self._reaper, f"{pgid} {created!r}")

    def __enter__(self) -> NodeWorkdir:
        return self

    def __exit__(self, *exc_info: object) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        if self._reaper is not None:
            _tell_reaper(self._reaper, "done")
            if self._reaper.stdin is not None:
                self._reaper.stdin.close()
            self._reaper.wait()
