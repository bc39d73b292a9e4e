"""What the suite's ``local-cluster`` applications leave in ``$SPARK_HOME/work``, removed at its end.

A ``local-cluster`` master's workers keep each application's executor directories (their working
directory: the files Spark fetched, the shipped spark_torch zip, the executors' stdout and stderr)
in ``$SPARK_HOME/work/app-<time>-<n>``, which is inside this environment's pyspark; Spark removes
none of them. A whole run made ~200 MB of them. At the end of a run the controller removes the
ones made since the run began that no process still uses (its working directory inside one): an
executor of another run in this environment, or one still exiting, keeps its directory.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def work_root() -> Path:
    """Where ``local-cluster`` workers keep applications' directories (``$SPARK_HOME/work``)."""
    import pyspark

    return Path(os.environ.get("SPARK_HOME") or os.path.dirname(pyspark.__file__)) / "work"


def working_directories() -> set[Path]:
    """The working directories of the processes this user can see."""
    found = set()
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                found.add(Path(os.readlink(f"/proc/{entry.name}/cwd")))
            except OSError:  # gone, or not ours to read
                continue
    return found


def remove_finished_applications(root: Path, since: float) -> tuple[list[Path], list[Path]]:
    """Remove the application directories under ``root`` changed at or after ``since`` (epoch
    seconds) that no process works in. Returns (removed, kept because in use)."""
    removed: list[Path] = []
    kept: list[Path] = []
    if not root.is_dir():
        return removed, kept
    in_use = working_directories()
    for app in sorted(root.glob("app-*")):
        try:
            if app.stat().st_mtime < since:
                continue
        except FileNotFoundError:
            continue
        if any(cwd == app or app in cwd.parents for cwd in in_use):
            kept.append(app)
            continue
        shutil.rmtree(app, ignore_errors=True)
        removed.append(app)
    return removed, kept
