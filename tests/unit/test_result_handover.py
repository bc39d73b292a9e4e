"""Node 0 hands rank 0's result over by file only into the driver's own result directory:
private to this user, holding the token of the run spec; anything else at that path (a
directory someone else made, a symlink, a shared one) is never written."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest

from spark_torch.node import result_transfer
from spark_torch.shared.spec import LaunchPlan, RunSpec
from spark_torch.shared.workdir_files import WorkdirFiles

SPEC = RunSpec(plan=LaunchPlan(local_mode=False, num_nodes=1, procs_per_node=1, use_gpu=False), run_id="t")


def _result(tmp_path: Path) -> str:
    path = tmp_path / "node" / "rank-0.result"
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(b"pickled result")
    return str(path)


def _driver_dir(tmp_path: Path) -> tuple[Path, str]:
    directory = tmp_path / "driver"
    directory.mkdir(mode=0o700)
    return directory, result_transfer.prepare_result_dir(str(directory))


def test_the_drivers_directory_gets_the_result(tmp_path: Path) -> None:
    directory, token = _driver_dir(tmp_path)
    spec = replace(SPEC, result_dir=str(directory), result_token=token)
    assert result_transfer.deliver(spec, _result(tmp_path), None) == (result_transfer.HANDED_OVER_SEQ, 14)
    assert Path(WorkdirFiles(str(directory)).handed_over_result()).read_bytes() == b"pickled result"


@pytest.mark.parametrize(
    "case", ["no token file", "another token", "no token in the spec", "open to others", "a symlink"]
)
def test_any_other_directory_at_that_path_is_never_written(tmp_path: Path, case: str) -> None:
    directory, token = _driver_dir(tmp_path)
    target = directory
    if case == "no token file":
        Path(WorkdirFiles(str(directory)).result_token()).unlink()
    elif case == "another token":
        token = "0" * 32
    elif case == "no token in the spec":
        token = ""
    elif case == "open to others":
        os.chmod(directory, 0o777)
    elif case == "a symlink":
        target = tmp_path / "link"
        target.symlink_to(directory)
    spec = replace(SPEC, result_dir=str(target), result_token=token)
    result = _result(tmp_path)
    assert result_transfer.deliver(spec, result, None) is None  # it goes through Spark instead
    assert not os.path.exists(WorkdirFiles(str(directory)).handed_over_result()) and os.path.exists(result)
