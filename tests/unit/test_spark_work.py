"""The suite's end removes the local-cluster applications' directories it made, and only those."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from tests.spark_work import remove_finished_applications


def test_only_this_runs_finished_applications_are_removed(tmp_path: Path) -> None:
    old, done, busy = (tmp_path / f"app-2026112800000{n}-0000" for n in range(3))
    for app in (old, done, busy):
        (app / "0").mkdir(parents=True)
        (app / "0" / "stderr").write_text("executor log\n")
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    (tmp_path / "not-an-app").mkdir()
    executor = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], cwd=busy / "0")
    try:
        removed, kept = remove_finished_applications(tmp_path, since=time.time() - 60)
    finally:
        executor.kill()
        executor.wait()
    assert removed == [done] and kept == [busy]
    assert old.is_dir() and busy.is_dir() and not done.exists() and (tmp_path / "not-an-app").is_dir()
    assert remove_finished_applications(tmp_path / "missing", since=0.0) == ([], [])
