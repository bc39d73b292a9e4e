"""Storage that the nodes cannot see stops the run at the rendezvous, before any rank starts,
naming the storage and the nodes (node/storage_check.py). ``memory://`` storage is the honest
case on one machine: it lives in the driver's process, and no executor sees it."""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from spark_torch import AttemptEnd, ConfigurationError, Distributor
from spark_torch.node.storage_check import SEEN, storage_hello, storage_needed, storage_problem
from spark_torch.shared.spec import LaunchPlan, RunSpec, StorageSpec


def touch(path: str) -> None:
    Path(path).touch()


def test_storage_only_the_driver_sees_fails_at_the_rendezvous(
    spark_session: Any, tmp_path: Path, no_leftovers: None
) -> None:
    base = f"memory://spark-torch-{uuid.uuid4().hex[:8]}"
    started = time.monotonic()
    distributor = Distributor(num_processes=2, local_mode=False, spark=spark_session, storage_path=base, timeout=120)
    with pytest.raises(ConfigurationError) as info:
        distributor.run(touch, str(tmp_path / "a rank ran"))
    # the attempt that found it is recorded with its end, not left open
    assert distributor.last_run is not None
    assert [a.end for a in distributor.last_run.attempts] == [AttemptEnd.MISCONFIGURED]
    message = str(info.value)
    assert (
        message.startswith(f"the run's storage {base}/")
        and " is not visible from 2 of 2 nodes: node 0 on 127.0.0.1 (the driver's marker is not there); node 1 on 127.0.0.1 ("
        in message
    ), message
    assert "pass storage_path= on storage every node can reach" in message and "\n" not in message
    assert not (tmp_path / "a rank ran").exists()
    assert time.monotonic() - started < 120


def test_storage_every_node_sees_passes(spark_session: Any, tmp_path: Path, no_leftovers: None) -> None:
    Distributor(num_processes=2, local_mode=False, spark=spark_session, storage_path=str(tmp_path / "runs")).run(
        touch, str(tmp_path / "a rank ran")
    )
    assert (tmp_path / "a rank ran").exists()


def _run(storage: StorageSpec | None, resume_url: str | None = None) -> RunSpec:
    plan = LaunchPlan(local_mode=False, num_nodes=2, procs_per_node=1, use_gpu=False)
    return RunSpec(plan=plan, run_id="r1", storage=storage, resume_url=resume_url)


def test_default_storage_is_checked_but_needed_only_to_resume(tmp_path: Path) -> None:
    """The default storage: a run that never checkpoints does not need it on the nodes (a
    warning), one that resumes from it does (an error)."""
    default = StorageSpec(base=str(tmp_path / "nowhere"), token="t")
    assert storage_hello(_run(default))[SEEN] is False and storage_hello(_run(None)) == {}
    assert not storage_needed(_run(default))
    assert storage_needed(_run(default, resume_url=str(tmp_path / "nowhere" / "r1" / "checkpoint-1")))
    assert storage_needed(_run(StorageSpec(base=str(tmp_path), token="t", required=True)))


def test_default_storage_the_nodes_cannot_see_is_warned_at_the_rendezvous(
    spark_session: Any, tmp_path: Path, monkeypatch: Any, capfd: Any, no_leftovers: None
) -> None:
    """A multi-host run on the default storage (which only the driver sees): the run goes on,
    and says before training that checkpoints would fail, naming the storage and the nodes."""
    import spark_torch.driver.run.call_storage as execution

    monkeypatch.setattr(execution, "DEFAULT_STORAGE", f"memory://spark-torch-{uuid.uuid4().hex[:8]}")
    Distributor(num_processes=2, local_mode=False, spark=spark_session).run(touch, str(tmp_path / "a rank ran"))
    assert (tmp_path / "a rank ran").exists()
    err = capfd.readouterr().err
    assert "report(checkpoint=...) will fail on these nodes: the run's storage memory://" in err, err[-2000:]
    assert "is not visible from 2 of 2 nodes" in err


def test_problem_names_only_the_blind_nodes(tmp_path: Path) -> None:
    run = _run(StorageSpec(base=str(tmp_path), token="t", required=True))
    peers = [{"host": "h0", SEEN: True}, {"host": "h1", SEEN: False, "storage_why": "PermissionError: denied"}]
    assert storage_problem(run, peers) == (
        f"the run's storage {tmp_path / 'r1'} is not visible from 1 of 2 nodes: node 1 on h1 (PermissionError: denied). "
        "Every node reads and writes checkpoints there: pass storage_path= on storage every node can reach (a shared "
        "filesystem mounted at the same path, or an fsspec URL such as s3://bucket/runs)"
    )
    assert storage_problem(run, [{"host": "h0", SEEN: True}]) is None
