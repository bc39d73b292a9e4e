"""The suite's private TMPDIRs: a folder is removed once the test process that made it has ended,
never while it runs (tests/session_tmp.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.session_tmp import OWNER, PREFIX, make_session_tmp, owner_alive, sweep_ended_sessions


def test_only_the_folders_of_ended_processes_are_swept(tmp_path: Path) -> None:
    mine = make_session_tmp(str(tmp_path))
    (Path(mine) / "kept").write_text("in use")
    # a process that made its folder and ended
    code = f"import sys; sys.path.insert(0, {str(Path(__file__).parents[2])!r}); from tests.session_tmp import make_session_tmp; print(make_session_tmp({str(tmp_path)!r}))"
    ended = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    (Path(ended) / "spark_torch_templates-0").mkdir()
    # a folder whose pid is alive but whose start time is another process's (a reused pid)
    reused = tmp_path / f"{PREFIX}reused"
    reused.mkdir()
    (reused / OWNER).write_text(f"{os.getpid()} 1.0")
    # a folder without an owner (an older suite's, or not ours to judge) and another name
    unowned = tmp_path / f"{PREFIX}unowned"
    unowned.mkdir()
    other = tmp_path / "something-else"
    other.mkdir()

    assert owner_alive(mine) and not owner_alive(ended) and not owner_alive(str(reused)) and owner_alive(str(unowned))
    assert sorted(sweep_ended_sessions(str(tmp_path))) == sorted([ended, str(reused)])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([Path(mine).name, unowned.name, other.name])
    assert (Path(mine) / "kept").read_text() == "in use"


def test_this_session_owns_its_tmpdir() -> None:
    tmp = os.environ["TMPDIR"]
    assert Path(tmp).name.startswith(PREFIX) and owner_alive(tmp)
    assert (Path(tmp) / OWNER).read_text().split()[0] == str(os.getpid())
