"""The NCCL watchdog's dump a failed rank leaves (spark_torch.node.torch_dumps): which file
counts, and how it travels to the driver and into the error. A real dump needs a GPU
(benchmarks/gpu_check.py's e_nccl_fr); tests/test_flight_recorder.py runs a rank that dies the
watchdog's way."""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path

from spark_torch.errors import DistributedRunError, RankFailure
from spark_torch.node.torch_dumps import DEFAULT_PREFIX, watchdog_dump
from spark_torch.shared.node_outcome import NodeOutcome
from spark_torch.shared.sealed import seal, unseal


def _dump(prefix: Path, rank: int, age: float = 0.0) -> str:
    path = f"{prefix}{rank}"
    Path(path).write_bytes(b"dump")
    if age:
        then = time.time() - age
        os.utime(path, (then, then))
    return path


def test_the_prefix_variables_name_the_dump(tmp_path: Path) -> None:
    prefix = tmp_path / "nccl_trace_rank_"
    path = _dump(prefix, 3)
    started = time.time() - 5
    assert watchdog_dump({"TORCH_FR_DUMP_TEMP_FILE": str(prefix)}, 3, started) == path
    assert watchdog_dump({"TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(prefix)}, 3, started) == path  # the older name
    assert watchdog_dump({"TORCH_FR_DUMP_TEMP_FILE": str(prefix)}, 2, started) is None  # another rank's


def test_the_newer_variable_wins(tmp_path: Path) -> None:
    newer, older = tmp_path / "new_", tmp_path / "old_"
    path = _dump(newer, 0)
    _dump(older, 0)
    env = {"TORCH_FR_DUMP_TEMP_FILE": str(newer), "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(older)}
    assert watchdog_dump(env, 0, time.time() - 5) == path


def test_a_dump_older_than_the_rank_is_not_its(tmp_path: Path) -> None:
    prefix = tmp_path / "nccl_trace_rank_"
    _dump(prefix, 0, age=600)
    assert watchdog_dump({"TORCH_FR_DUMP_TEMP_FILE": str(prefix)}, 0, time.time() - 60) is None


def test_a_folder_at_the_path_is_not_a_dump(tmp_path: Path) -> None:
    prefix = tmp_path / "nccl_trace_rank_"
    os.mkdir(f"{prefix}0")
    assert watchdog_dump({"TORCH_FR_DUMP_TEMP_FILE": str(prefix)}, 0, time.time() - 5) is None


def test_torchs_default_place_only_when_dumps_were_asked_for() -> None:
    # /tmp/nccl_trace_rank_<rank> is torch's default; a rank number no run here uses keeps it clean
    rank = 900_000 + os.getpid() % 10_000
    path = f"{DEFAULT_PREFIX}{rank}"
    try:
        Path(path).write_bytes(b"dump")
        assert watchdog_dump({}, rank, time.time() - 5) is None
        assert watchdog_dump({"TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}, rank, time.time() - 5) == path
        assert watchdog_dump({"TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}, rank, time.time() - 5) is None
    finally:
        os.unlink(path)


def test_the_dump_travels_and_the_error_names_it() -> None:
    failure = RankFailure(
        rank=1, host="node-a", signal_name="SIGABRT", failed_at=1.0, dumps=("/logs/nccl_trace_rank_1",)
    )
    secret = secrets.token_bytes(32)
    _, outcome = unseal(seal(0, NodeOutcome(failures=(failure,)), secret), secret)
    assert outcome.failures[0].dumps == ("/logs/nccl_trace_rank_1",)
    message = str(DistributedRunError(outcome.failures))
    assert message.splitlines()[0] == "rank 1 on node-a failed: killed by SIGABRT"
    assert "dump of rank 1 (its Flight Recorder) is on node-a: /logs/nccl_trace_rank_1" in message
    assert "torchfrtrace /logs --prefix nccl_trace_rank_ --allow-incomplete-ranks" in message
    # a failure without one says nothing of dumps
    assert "dump" not in str(DistributedRunError([RankFailure(rank=0, host="h", signal_name="SIGKILL")]))
