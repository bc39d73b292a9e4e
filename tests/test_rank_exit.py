"""A rank ends like a Python program (non-daemon threads joined, executor work finished, atexit
run, unclosed files flushed) but without the slow interpreter teardown; and it dies with its
node runner."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from spark_torch import Distributor

from .conftest import SCRIPTS

EXPECTED = {"thread": "uploaded", "unclosed": "buffered " * 10, "atexit": "ran", "pool": "done"}


def exit_semantics_fn(out: str) -> str:
    import runpy
    import sys

    sys.argv = ["exit_semantics.py", out]
    runpy.run_path(os.path.join(os.environ["SCRIPTS_DIR"], "exit_semantics.py"))
    return "returned"


def _check(out: Path, ranks: int) -> None:
    for rank in range(ranks):
        for name, content in EXPECTED.items():
            path = out / f"{name}-{rank}.txt"
            assert path.exists(), f"{path.name} is missing: rank {rank} exited before Python's shutdown steps"
            assert path.read_text() == content


def test_function_mode_exit(tmp_path: Path, no_leftovers: None) -> None:
    out = Distributor(num_processes=2, env={"SCRIPTS_DIR": str(SCRIPTS)}).run(exit_semantics_fn, str(tmp_path))
    assert out == "returned"
    _check(tmp_path, 2)


def test_script_mode_exit(tmp_path: Path, no_leftovers: None) -> None:
    Distributor(num_processes=2).run(str(SCRIPTS / "exit_semantics.py"), tmp_path)
    _check(tmp_path, 2)


def test_distributed_exit(spark_session: Any, tmp_path: Path, no_leftovers: None) -> None:
    Distributor(num_processes=2, local_mode=False, spark=spark_session).run(
        str(SCRIPTS / "exit_semantics.py"), tmp_path
    )
    _check(tmp_path, 2)


ARMED_CHILD = (
    "import os, sys, time\n"
    "from spark_torch.rank.deathsig import die_with_parent\n"
    "die_with_parent()\n"
    "print(os.getpid(), flush=True)\n"
    "time.sleep(600)\n"
)


def test_rank_dies_with_its_node_runner() -> None:
    """The rank arms PR_SET_PDEATHSIG itself (no preexec_fn): killing its parent kills it."""
    parent_code = (
        "import os, subprocess, sys, time\n"
        f"child = subprocess.Popen([sys.executable, '-c', {ARMED_CHILD!r}],"
        " env=dict(os.environ, SPARK_TORCH_PARENT_PID=str(os.getpid())))\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    child_pid = int(parent.stdout.readline())
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            os.kill(child_pid, 0)
        except ProcessLookupError:
            return
        try:  # reaped by init or a subreaper; a zombie counts as gone
            with open(f"/proc/{child_pid}/stat") as fh:
                if fh.read().split()[2] == "Z":
                    return
        except FileNotFoundError:
            return
        time.sleep(0.05)
    os.kill(child_pid, signal.SIGKILL)
    pytest.fail("the rank outlived its node runner")


def test_rank_whose_parent_is_already_gone_exits() -> None:
    """The parent died between fork and prctl: the rank notices (another parent) and exits."""
    done = subprocess.run(
        [sys.executable, "-c", ARMED_CHILD],
        env=dict(os.environ, SPARK_TORCH_PARENT_PID="1"),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 137 and done.stdout == ""


def test_text_files_are_flushed_before_their_binary_buffers(tmp_path: Path) -> None:
    """Closing a text file's binary buffer first would drop what only the text layer held
    (found when warm-started ranks lost a never-closed file's content)."""
    path = tmp_path / "text.txt"
    code = (
        f"import os\nf = open({str(path)!r}, 'w')\nf.write('kept')\n"
        "from spark_torch.rank.shutdown import flush_open_files\n"
        "assert flush_open_files() >= 1\nos._exit(0)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    assert path.read_text() == "kept"


def test_the_scan_for_open_files_runs_only_when_one_could_hold_data(tmp_path: Path) -> None:
    """The scan of every object (100-150 ms with torch imported) is skipped when no descriptor
    but the standard streams, the report pipes and spark_torch's own is open for writing; a
    file open for writing, a pipe's write end or a socket brings it back."""
    code = (
        "import gc, os, socket, sys\n"
        "from spark_torch.rank import shutdown\n"
        "scans = []\n"
        "real = gc.get_objects\n"
        "gc.get_objects = lambda *a: scans.append(1) or real(*a)\n"
        "r, w = os.pipe()\n"
        "os.environ['SPARK_TORCH_REPORT_FDS'] = f'{w},{r}'\n"
        "reading = open(sys.argv[1] + '.r', 'w'); reading.close(); reading = open(sys.argv[1] + '.r')\n"
        "assert shutdown.flush_open_files() == 0 and scans == [], scans  # a file open for reading only\n"
        "own = open(sys.argv[1] + '.own', 'a'); shutdown.own_descriptor(own.fileno())\n"
        "assert shutdown.flush_open_files() == 0 and scans == [], scans\n"
        "os.environ['SPARK_TORCH_REPORT_FDS'] = ''\n"
        "shutdown.flush_open_files(); assert scans == [1], scans  # a pipe's write end\n"
        "os.close(w)\n"
        "s = socket.socket()\n"
        "shutdown.flush_open_files(); assert scans == [1, 1], scans\n"
        "s.close()\n"
        "f = open(sys.argv[1], 'w'); f.write('kept')\n"
        "assert shutdown.flush_open_files() >= 1 and len(scans) == 3, scans\n"
        "print('ok')\n"
        "os._exit(0)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "data.txt")], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr
    assert (tmp_path / "data.txt").read_text() == "kept"
