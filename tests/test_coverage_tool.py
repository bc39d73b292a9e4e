"""``make coverage`` measures every process a run starts (pyproject.toml's ``[tool.coverage.run]``):
a local-mode run under ``coverage run`` leaves lines of the rank's own entry point (a process forked
from the warm-start template, or started cold), of the keeper (a subprocess) and of the driver."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import TESTS

ROOT = TESTS.parent

PROGRAM = """
from spark_torch import Distributor

def total():
    import os
    return int(os.environ["WORLD_SIZE"])

assert Distributor(num_processes=2, log_ranks=[], warm_start={warm}).run(total) == 2
"""


def _covered(data: Path, module: str) -> set[int]:
    import coverage

    cov = coverage.Coverage(data_file=str(data))
    cov.load()
    measured = cov.get_data()
    path = next((f for f in measured.measured_files() if f.endswith(module)), None)
    return set(measured.lines(path) or []) if path else set()


@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
def test_coverage_run_measures_the_ranks_and_the_keeper(warm: bool, tmp_path: Path, no_leftovers: None) -> None:
    pytest.importorskip("coverage")
    data = tmp_path / "data"
    env = dict(os.environ, COVERAGE_FILE=str(data))
    program = tmp_path / "program.py"
    program.write_text(PROGRAM.format(warm=warm))
    run = subprocess.run(
        [sys.executable, "-m", "coverage", "run", "--rcfile", str(ROOT / "pyproject.toml"), str(program)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    combine = subprocess.run(
        [sys.executable, "-m", "coverage", "combine", "--rcfile", str(ROOT / "pyproject.toml"), str(tmp_path)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert combine.returncode == 0, combine.stderr[-3000:]
    assert _covered(data, "spark_torch/rank/function_main.py"), "no line of the ranks' entry point was measured"
    assert _covered(data, "spark_torch/node/keeper.py"), "no line of the rank keeper (a subprocess) was measured"
    assert _covered(data, "spark_torch/driver/api/distributor.py"), "the driver was not measured"
