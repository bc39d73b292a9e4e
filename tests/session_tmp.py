"""Each test process's private TMPDIR, and the sweep of those whose process has ended.

Every pytest process (the controller and each xdist worker) makes its own
``spark-torch-tests-*`` folder and names itself its owner (pid and start time, so a reused pid is
not taken for it). Whatever that session's JVMs, Python workers, ranks and warm-start templates
leave there lives as long as the session; once its owner has ended, the next session removes the
folder. A live session's folder is never touched, however old.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import psutil

PREFIX = "spark-torch-tests-"
OWNER = ".owner"


def _start_time(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


def make_session_tmp(base: str) -> str:
    """A new private folder under ``base`` owned by this process."""
    path = tempfile.mkdtemp(prefix=PREFIX, dir=base)
    with open(os.path.join(path, OWNER), "w", encoding="utf-8") as fh:
        fh.write(f"{os.getpid()} {_start_time(os.getpid())!r}")
    return path


def owner_alive(path: str) -> bool:
    """Whether the process that made ``path`` still runs (a folder without a readable owner is
    taken as alive: it is not ours to judge)."""
    try:
        with open(os.path.join(path, OWNER), encoding="utf-8") as fh:
            pid_text, _, started_text = fh.read().partition(" ")
        pid, started = int(pid_text), float(started_text)
    except (OSError, ValueError):
        return True
    now = _start_time(pid)
    return now is not None and abs(now - started) < 0.01


def sweep_ended_sessions(base: str) -> list[str]:
    """Remove the folders under ``base`` of test processes that have ended; returns them."""
    removed = []
    for name in sorted(os.listdir(base)):
        path = os.path.join(base, name)
        if not name.startswith(PREFIX) or os.path.islink(path) or not os.path.isdir(path):
            continue
        try:
            if os.stat(path).st_uid != os.getuid() or owner_alive(path):
                continue
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed
