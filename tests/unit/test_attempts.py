"""An attempt's record as data: its size and why (``AttemptSize``), the error it ended with
(``AttemptError``), why it grew (``GrowRequest``), the GPU fallback of a plan (``GpuFallback``),
each with the words it prints; the membership choosing a size; an old attempt log still loads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import spark_torch
from spark_torch import AttemptEnd, AttemptReason, AttemptRecord, RunResult
from spark_torch.driver.api.past_runs import run_details
from spark_torch.driver.config import DistributorConfig
from spark_torch.driver.result import AttemptError, AttemptSize, GrowRequest, SizeReason
from spark_torch.driver.run import membership
from spark_torch.driver.run.membership import Membership
from spark_torch.driver.run.plan import HostFacts, make_plan
from spark_torch.driver.spark.cluster import ClusterInfo
from spark_torch.reporting.storage import RunStorage
from spark_torch.shared.spec import GpuFallback


def test_a_size_says_why_in_words() -> None:
    fewer = AttemptSize(SizeReason.FEWER_SLOTS, nodes=2, max_nodes=3, procs_per_node=1)
    assert (fewer.ranks, fewer.max_ranks) == (2, 3)
    assert str(fewer) == "2 of 3 ranks: slots for 2 of 3 nodes"
    assert str(AttemptSize(SizeReason.FEWER_SLOTS, 1, 2, 4)) == "4 of 8 ranks: slots for 1 of 2 nodes"
    assert str(AttemptSize(SizeReason.ALL_NODES, 3, 3, 1)) == "all nodes"
    assert str(AttemptSize(SizeReason.ALL_NODES_AGAIN, 3, 3, 1)) == "all nodes again"
    assert str(AttemptSize(SizeReason.SLOTS_UNKNOWN, 3, 3, 1)) == "slots unknown: all nodes"


def test_an_error_is_its_type_name_and_first_line() -> None:
    error = AttemptError.from_exception(RuntimeError("rank 1 failed\nTraceback ..."))
    assert error == AttemptError("RuntimeError", "rank 1 failed") and str(error) == "rank 1 failed"
    assert str(AttemptError.from_exception(KeyboardInterrupt())) == "KeyboardInterrupt"  # no message: the type
    assert len(AttemptError.from_exception(ValueError("x" * 1000)).first_line) == 300


def test_a_grow_request_says_why_in_words() -> None:
    grow = GrowRequest(running=1, nodes=2, waited=3.0, step=4)
    assert str(grow) == "slots for 2 nodes were free for 3s: growing from 1 to 2 nodes after the checkpoint of step 4"


def test_a_record_prints_one_line_from_its_fields() -> None:
    record = AttemptRecord(
        attempt=1,
        world_size=2,
        nodes=2,
        reason=AttemptReason.RESTART_AFTER_FAILURE,
        size=AttemptSize(SizeReason.FEWER_SLOTS, 2, 3, 1),
        end=AttemptEnd.FAILED,
        error=AttemptError("DistributedRunError", "rank 0 failed: boom"),
    )
    assert record.size_note == "2 of 3 ranks: slots for 2 of 3 nodes" and record.detail == "rank 0 failed: boom"
    assert str(record) == (
        "attempt 1: 2 rank(s) on 2 node(s), restart after a failure (2 of 3 ranks: slots for 2 of 3 nodes); "
        "failed: rank 0 failed: boom"
    )
    grew = AttemptRecord(0, 1, 1, AttemptReason.START, end=AttemptEnd.GROW_REQUESTED, grow=GrowRequest(1, 2, 3, 4))
    assert grew.detail == str(grew.grow) and str(grew).endswith("; grow requested: " + str(grew.grow))
    local = AttemptRecord(0, 2, 1, AttemptReason.START, end=AttemptEnd.SUCCEEDED)
    assert local.size_note == "" and local.detail is None
    assert str(local) == "attempt 0: 2 rank(s) on 1 node(s), start; succeeded"


def test_the_membership_sizes_an_attempt(monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    slots: list[int | None] = [2]
    monkeypatch.setattr(membership, "available_slots", lambda spark: slots[0])
    monkeypatch.setattr(membership, "can_wait", lambda spark: False)
    monkeypatch.setattr(membership, "check_slots", lambda spark, nodes, wait: None)
    monkeypatch.setattr(membership, "master_of", lambda spark: "local[2]")
    elastic = Membership(max_nodes=3, min_nodes=2, procs_per_node=1, elastic_wait=0, executor_wait=0)
    with caplog.at_level("WARNING", logger="spark_torch"):
        assert elastic.nodes_for(None, first=True) == AttemptSize(SizeReason.FEWER_SLOTS, 2, 3, 1)
    assert caplog.messages == [
        "spark_torch: starting with 2 of 3 ranks (min_processes=2): the cluster has slots for 2 of 3 nodes"
    ]
    slots[0] = 3
    assert elastic.nodes_for(None, first=False).reason is SizeReason.ALL_NODES_AGAIN
    slots[0] = None
    assert elastic.nodes_for(None, first=True) == AttemptSize(SizeReason.SLOTS_UNKNOWN, 3, 3, 1)
    fixed = Membership(max_nodes=2, min_nodes=2, procs_per_node=2, elastic_wait=0, executor_wait=0)
    assert fixed.nodes_for(None, first=True) == AttemptSize(SizeReason.ALL_NODES, 2, 2, 2)
    assert fixed.nodes_for(None, first=False) == AttemptSize(SizeReason.ALL_NODES_AGAIN, 2, 2, 2)


def test_a_plan_says_why_it_left_the_gpus_unused() -> None:
    host = HostFacts(gpus_found=("3",), gpus_found_by="nvidia-smi")
    plan = make_plan(DistributorConfig(num_processes=2), ClusterInfo(), cpu_count=4, host=host)
    assert not plan.use_gpu and plan.gpu_fallback == GpuFallback(ranks=2, gpus=("3",))
    assert str(plan.gpu_fallback) == (
        "spark_torch: 2 ranks but this machine has 1 GPU(s) (3): training on CPU. Pass num_processes<=1 to "
        "train on the GPUs, use_gpu=True to make this an error, or use_gpu=False to silence this"
    )
    assert make_plan(DistributorConfig(num_processes=1), ClusterInfo(), cpu_count=4, host=host).gpu_fallback is None


def test_an_old_attempt_log_still_loads(tmp_path: Path) -> None:
    """Attempt logs written by earlier versions (with or without free-text fields) still load:
    as past runs, in ``spark-torch runs show``, and as a RunResult."""
    storage = RunStorage(str(tmp_path), "old", {})
    storage.create("token")
    rows = [
        {"attempt": 0, "world_size": 3, "nodes": 3, "time": 1700000000.0},
        {
            "attempt": 1,
            "world_size": 2,
            "nodes": 2,
            "time": 1700000100.0,
            "size_note": "2 of 3 ranks: slots for 2 of 3 nodes",
            "detail": "rank 2 failed",
        },
    ]
    (tmp_path / "old" / "attempts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (summary,) = spark_torch.list_runs(tmp_path)
    assert summary.attempts == 2 and summary.world_size == 2 and summary.attempt_log == rows
    text = run_details(summary, [])
    assert "attempt 0: 3 rank(s) on 3 node(s)" in text and "attempt 1: 2 rank(s) on 2 node(s)" in text
    assert storage.next_attempt() == 2
    result = RunResult.from_path(tmp_path / "old")
    assert result.run_id == "old" and result.history == [] and result.checkpoint is None
