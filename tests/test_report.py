"""report(), get_checkpoint(), resume: metrics recorded once per step, checkpoints persisted
before report() returns, runs that lose a rank restart from the latest checkpoint and end with
the weights of an uninterrupted run; in function and script mode, local and distributed mode."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from spark_torch import (
    ConfigurationError,
    DistributedRunError,
    Distributor,
    RunStalledError,
    RunTimeoutError,
    get_checkpoint,
    report,
)
from spark_torch.reporting.storage import MANIFEST, RunStorage

from .conftest import SCRIPTS
from .report_programs import (
    deterministic_ddp,
    fail_first_attempts,
    report_after_hiding_storage,
    report_and_check_persisted,
    report_bad_metric,
    report_on_rank_0_in_a_ddp_loop,
    report_on_rank_0_only,
    report_scores,
    report_steps,
    report_then_fail_on_rank_1,
)


def _same_weights(a: dict[str, Any], b: dict[str, Any]) -> bool:
    import torch

    return all(torch.equal(x, y) for x, y in zip(a["weights"], b["weights"]))


def _steps(distributor: Distributor) -> list[int]:
    assert distributor.last_run is not None
    return [row["step"] for row in distributor.last_run.rows]


def test_metrics_rows_and_result(tmp_path: Path, no_leftovers: None) -> None:
    d = Distributor(num_processes=2, storage_path=tmp_path)
    out = d.run(deterministic_ddp, 6, 3)
    result = d.last_run
    assert result is not None and result.error is None and result.restarts == 0 and out["resumed_from"] is None
    assert _steps(d) == [1, 2, 3, 4, 5, 6] and {r["attempt"] for r in result.rows} == {0}
    frame = result.metrics_dataframe
    assert list(frame.columns) == ["loss", "rank0_step", "step", "time", "attempt", "world_size"]
    assert frame["rank0_step"].tolist() == frame["step"].tolist() and frame["loss"].dtype == float
    assert result.metrics["step"] == 6 and result.metrics["loss"] == frame["loss"].iloc[-1]  # the last row, as a dict
    assert result.checkpoint is not None and result.checkpoint.step == 6
    assert result.checkpoint.path == str(tmp_path / result.run_id / "checkpoint_000006") == os.fspath(result.checkpoint)
    assert result.checkpoint.to_directory() == result.checkpoint.path and result.path == str(tmp_path / result.run_id)
    assert sorted(os.listdir(tmp_path / result.run_id)) == [
        ".spark_torch_run",
        "attempts.jsonl",
        "checkpoint_000003",
        "checkpoint_000006",
        "metrics.jsonl",
        "run.jsonl",
    ]
    manifest = json.loads((Path(result.checkpoint) / MANIFEST).read_text())
    assert manifest["step"] == 6 and manifest["ranks"] == [0]
    logged = [json.loads(line) for line in (tmp_path / result.run_id / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in logged] == [1, 2, 3, 4, 5, 6]


def test_rank_killed_mid_run_resumes_from_the_checkpoint(tmp_path: Path, no_leftovers: None) -> None:
    """Rank 1 SIGKILLs itself in step 8 of 10 (checkpoints every 3 steps, so step 7 was
    reported after the last checkpoint): the gang restarts from step 6; the weights equal an
    uninterrupted run's; every step appears exactly once (step 7 from the second attempt)."""
    clean = Distributor(num_processes=2, storage_path=tmp_path).run(deterministic_ddp, 10, 3)
    chaos = Distributor(num_processes=2, storage_path=tmp_path, max_restarts=1)
    out = chaos.run(deterministic_ddp, 10, 3, die_at=8)
    assert chaos.last_run is not None and chaos.last_run.restarts == 1
    assert out["resumed_from"] == 6 and _same_weights(clean, out)
    assert _steps(chaos) == list(range(1, 11))
    assert [r["attempt"] for r in chaos.last_run.rows] == [0] * 6 + [1] * 4


def test_distributed_rank_killed_mid_run(spark_session: Any, tmp_path: Path, no_leftovers: None) -> None:
    clean = Distributor(num_processes=2, local_mode=False, spark=spark_session, storage_path=tmp_path).run(
        deterministic_ddp, 8
    )
    chaos = Distributor(num_processes=2, local_mode=False, spark=spark_session, storage_path=tmp_path, max_restarts=1)
    out = chaos.run(deterministic_ddp, 8, die_at=5, die_rank=0)
    assert out["resumed_from"] == 4 and _same_weights(clean, out)
    assert _steps(chaos) == list(range(1, 9)) and chaos.last_run is not None and chaos.last_run.restarts == 1


def test_resume_by_run_id_in_a_new_run(tmp_path: Path, no_leftovers: None) -> None:
    """A run that stopped (here: ran out of restarts) resumes when run() is called again with its run_id."""
    first = Distributor(num_processes=2, storage_path=tmp_path, run_id="exp-1")
    with pytest.raises(DistributedRunError, match="killed by SIGKILL"):
        first.run(deterministic_ddp, 8, die_at=5)
    assert first.last_run is not None and first.last_run.error is not None
    assert first.last_run.checkpoint is not None and first.last_run.checkpoint.path.endswith("checkpoint_000004")
    assert _steps(first) == [1, 2, 3, 4]
    again = Distributor(num_processes=2, storage_path=tmp_path, run_id="exp-1")
    out = again.run(deterministic_ddp, 8)
    clean = Distributor(num_processes=2, storage_path=tmp_path).run(deterministic_ddp, 8)
    assert out["resumed_from"] == 4 and _same_weights(clean, out)
    assert _steps(again) == [5, 6, 7, 8]  # this call's rows
    # the resumed call's attempt numbers on from the first call's (attempt 0 reported steps 1-4)
    assert again.last_run is not None and [a.attempt for a in again.last_run.attempts] == [1]
    assert {r["attempt"] for r in again.last_run.rows} == {1} and again.last_run.restarts == 0
    assert again.last_run.metrics_dataframe["attempt"].tolist() == [0] * 4 + [1] * 4
    assert again.last_run is not None and again.last_run.metrics_dataframe["step"].tolist() == list(
        range(1, 9)
    )  # the run's
    assert again.last_run.metrics["step"] == 8


def test_sharded_checkpoints_merge_and_keep_checkpoints(tmp_path: Path, no_leftovers: None) -> None:
    d = Distributor(num_processes=2, storage_path=tmp_path, keep_checkpoints=2)
    d.run(deterministic_ddp, 8, sharded=True)
    assert d.last_run is not None
    run_dir = tmp_path / d.last_run.run_id
    assert sorted(p.name for p in run_dir.glob("checkpoint_*")) == ["checkpoint_000006", "checkpoint_000008"]
    assert sorted(os.listdir(run_dir / "checkpoint_000008")) == [MANIFEST, "shard-0.pt", "shard-1.pt", "state.pt"]
    assert json.loads((run_dir / "checkpoint_000008" / MANIFEST).read_text())["ranks"] == [0, 1]


def test_fsspec_url_storage(tmp_path: Path, no_leftovers: None) -> None:
    """Storage given as an fsspec URL (file://) goes through fsspec, like s3:// would."""
    url = f"file://{tmp_path}/remote"
    clean = Distributor(num_processes=2, storage_path=tmp_path / "plain").run(deterministic_ddp, 6)
    d = Distributor(num_processes=2, storage_path=url, max_restarts=1)
    out = d.run(deterministic_ddp, 6, die_at=5)
    assert d.last_run is not None and d.last_run.checkpoint is not None
    assert d.last_run.checkpoint.path == f"{url}/{d.last_run.run_id}/checkpoint_000006"
    copy = d.last_run.checkpoint.to_directory(tmp_path / "copy")  # a URL: downloaded into a local directory
    assert sorted(os.listdir(copy)) == [MANIFEST, "state.pt"]
    assert out["resumed_from"] == 4 and _same_weights(clean, out)


def test_script_mode_reports_and_resumes(tmp_path: Path, no_leftovers: None) -> None:
    os.environ["EPOCHS"] = "3"
    d = Distributor(num_processes=2, storage_path=tmp_path, run_id="script-run")
    assert d.run(str(SCRIPTS / "report_script.py")) is None
    assert d.last_run is not None and [r["epoch"] for r in d.last_run.rows] == [0, 1, 2]
    os.environ["EPOCHS"] = "5"  # train further: resumes after epoch 2
    d.run(str(SCRIPTS / "report_script.py"))
    assert [(r["step"], r["epoch"]) for r in d.last_run.rows] == [(4, 3), (5, 4)]


def test_report_misuse(spark_session: Any, no_leftovers: None) -> None:
    with pytest.raises(RuntimeError, match="works inside ranks started by spark_torch"):
        report({"loss": 1.0})
    assert get_checkpoint() is None
    with pytest.raises(DistributedRunError) as info:
        Distributor(num_processes=1).run(report_bad_metric)
    assert "TypeError: report(): metric 'weights' is a list" in str(info.value)
    # refused at the sender, in the rank, before anything travels (a surrogate cannot be encoded
    # as UTF-8 on the channel; one step's metrics travel in one message)
    with pytest.raises(DistributedRunError) as info:
        Distributor(num_processes=2, local_mode=False, spark=spark_session).run(report_bad_metric, "surrogate")
    assert "ValueError: report(): metric 'name' is a string that is not valid Unicode" in str(info.value)
    with pytest.raises(DistributedRunError) as info:
        Distributor(num_processes=1).run(report_bad_metric, "huge")
    assert "the metrics take 100013 bytes as JSON, more than 65536" in str(info.value)
    with pytest.raises(ValueError, match="run_id must be"):
        Distributor(run_id="../escape")
    with pytest.raises(ValueError, match="keep_checkpoints must be >= 1"):
        Distributor(keep_checkpoints=0)


def test_storage_not_visible_from_a_rank(tmp_path: Path, no_leftovers: None) -> None:
    """A rank that cannot see the driver's storage (another host, a local path) says so."""
    with pytest.raises(DistributedRunError) as info:
        Distributor(num_processes=1, storage_path=tmp_path).run(report_after_hiding_storage, str(tmp_path))
    assert "is not visible from" in str(info.value) and "storage every node can reach" in str(info.value)


def test_unwritable_storage_path(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ValueError, match="cannot create the run's directory"):
        Distributor(storage_path=blocker / "runs").run(report_steps, 0)


def test_storage_unit(tmp_path: Path) -> None:
    storage = RunStorage(str(tmp_path), "r1", {})
    storage.create("tok")
    assert storage.visible("tok") and not storage.visible("other")
    for step in (1, 2, 3):
        src = tmp_path / f"src{step}"
        src.mkdir()
        (src / "a.txt").write_text(str(step))
        storage.upload(str(src), step)
        if step < 3:
            storage.complete(step, 0, [0])
    complete, incomplete = storage.checkpoints()
    assert [c.step for c in complete] == [1, 2] and incomplete == [3]
    assert storage.latest() is not None and storage.latest().step == 2  # type: ignore[union-attr]
    assert storage.prune(1) == [1] and [c.step for c in storage.checkpoints()[0]] == [2]
    storage.discard_incomplete_after(2)
    assert storage.checkpoints() == (storage.checkpoints()[0], [])


@pytest.mark.slow
def test_executor_jvm_killed_mid_run(cluster_spark: Any, tmp_path: Path, no_leftovers: None) -> None:
    """local-cluster: the executor JVM of node 1 is SIGKILLed after step 5 was reported; Spark
    loses the node, the gang restarts (on a fresh executor) from step 4's checkpoint."""
    from .report_programs import kill_my_executor_at

    clean = Distributor(num_processes=2, local_mode=False, spark=cluster_spark, storage_path=tmp_path).run(
        deterministic_ddp, 8
    )
    chaos = Distributor(num_processes=2, local_mode=False, spark=cluster_spark, storage_path=tmp_path, max_restarts=1)
    out = chaos.run(kill_my_executor_at, 5, 8)
    assert chaos.last_run is not None and chaos.last_run.restarts == 1
    assert out["resumed_from"] == 4 and _same_weights(clean, out)
    assert _steps(chaos) == list(range(1, 9))
    assert [r["attempt"] for r in chaos.last_run.rows] == [0] * 4 + [1] * 4


def test_slow_persisting_keeps_report_in_step(
    tmp_path: Path, spark_session: Any, no_leftovers: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Persisting a step takes longer than the channel's dead-connection time (slow remote
    storage, MLflow, the chart): heartbeats are still answered, no answer is replayed into a
    later step, and report() on every rank returns only after its own step is persisted."""
    import time

    from spark_torch.driver.console.tracker import ReportTracker

    slow_row = ReportTracker.row

    def row(self: ReportTracker, data: dict[str, Any]) -> None:
        if data["step"] in (2, 3):
            time.sleep(1.5)  # over 4 heartbeats of 0.3 s: the connection's dead time
        slow_row(self, data)

    monkeypatch.setattr(ReportTracker, "row", row)
    d = Distributor(num_processes=2, local_mode=False, spark=spark_session, storage_path=tmp_path, heartbeat=0.3)
    assert d.run(report_and_check_persisted, str(tmp_path), 5) == [1, 2, 3, 4, 5]
    assert _steps(d) == [1, 2, 3, 4, 5]


def test_a_step_waits_for_every_rank_and_is_answered_once() -> None:
    """The node's report pipes (real pipes, no ranks): a step is forwarded only once every rank
    of the node reported it, even if one rank reports before the other's pipes exist; a
    replayed answer (the driver resends its last one to a node that reconnects) is not written
    to the ranks again."""
    import time

    from spark_torch.reporting.pipes import NodeReports

    forwarded: list[dict[str, Any]] = []
    pipes = NodeReports(0, range(2), forward=forwarded.append)
    try:  # the child ends stay with ``pipes`` (a rank would get copies): it closes them
        w0, r0 = pipes.open(0)
        os.write(w0, b'{"step": 1, "metrics": {"a": 1}, "checkpoint": false}\n')
        time.sleep(0.2)  # rank 0's line is read before rank 1's pipes even exist
        w1, _ = pipes.open(1)
        time.sleep(0.2)
        assert forwarded == [], "step 1 was forwarded with only rank 0's report"
        os.write(w1, b'{"step": 1, "metrics": null, "checkpoint": false}\n')
        deadline = time.monotonic() + 5.0
        while not forwarded and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [f["step"] for f in forwarded] == [1] and forwarded[0]["metrics"] == {"a": 1}
        pipes.persisted(1)
        pipes.persisted(1)  # the replay
        pipes.persisted(2, "later")
        os.set_blocking(r0, False)
        answers = os.read(r0, 4096).decode().splitlines()
        assert [json.loads(a)["step"] for a in answers] == [1, 2], answers
    finally:
        pipes.close()


@pytest.mark.parametrize(
    ("local_mode", "rank_1_gone_first", "together"),
    [(True, True, 0), (True, False, 2), (False, True, 2), (False, False, 0)],
    ids=["local-ended-first", "local-reported-first", "distributed-ended-first", "distributed-reported-first"],
)
def test_report_on_some_ranks_fails_at_once_naming_the_ranks_that_ended(
    local_mode: bool, rank_1_gone_first: bool, together: int, spark_session: Any, tmp_path: Path, no_leftovers: None
) -> None:
    """report() is a collective: rank 0 calling it while rank 1 has ended fails on rank 0 at
    once (``timeout`` is only the deadline of a regression: it would wait 10 minutes), whichever
    of the two comes first, after steps every rank reported or before any."""
    d = Distributor(
        num_processes=2,
        local_mode=local_mode,
        spark=None if local_mode else spark_session,
        storage_path=tmp_path / "runs",
        timeout=120,
        log_ranks=[],
    )
    with pytest.raises(DistributedRunError) as caught:
        d.run(report_on_rank_0_only, together, str(tmp_path), rank_1_gone_first)
    error = caught.value
    assert error.rank == 0 and not isinstance(error, RunTimeoutError), str(error)
    step = together + 1
    assert (
        f"RuntimeError: report(): step {step} cannot complete: report() is a collective every rank must call, the same "
        f"number of times: rank(s) 1 ended without calling it for step {step} (after step {together}). Call report() "
        "on every rank (pass checkpoint= only on the ranks that have files to save), not under `if rank == 0:`"
    ) in str(error)
    assert d.last_run is not None and [row["step"] for row in d.last_run.rows] == list(range(1, step))


@pytest.mark.parametrize("local_mode", [True, False], ids=["local", "distributed"])
def test_report_on_rank_0_while_rank_1_waits_in_a_collective_fails_in_seconds(
    local_mode: bool, spark_session: Any, tmp_path: Path, no_leftovers: None
) -> None:
    """report() under ``if rank == 0:`` in a DDP loop: rank 0 waits in report(), rank 1 in the
    next all_reduce. Neither rank ends, so only their positions tell: the run fails once both
    have waited REPORT_DEADLOCK_SECONDS, at the default stall_timeout (120 s) and
    stall_action ("warn"), with the report() error and both stacks."""
    d = Distributor(
        num_processes=2,
        local_mode=local_mode,
        spark=None if local_mode else spark_session,
        storage_path=tmp_path / "runs",
        timeout=240,
        log_ranks=[],
    )
    started = time.monotonic()
    with pytest.raises(DistributedRunError) as caught:
        d.run(report_on_rank_0_in_a_ddp_loop, 5)
    error = caught.value
    assert not isinstance(error, (RunTimeoutError, RunStalledError)), str(error)
    message = str(error)
    assert message.startswith(
        "report() is a collective every rank must call, the same number of times: rank(s) 0 wait in report() while "
        "rank(s) 1 did not call it and wait in all_reduce, from report_on_rank_0_in_a_ddp_loop for "
    ), message
    assert "Call report() on every rank" in message and "not under `if rank == 0:`" in message
    assert set(error.stacks) == {0, 1} and "spark_torch.report(" in message
    assert time.monotonic() - started < 120  # REPORT_DEADLOCK_SECONDS after both wait; timeout=240 is only the deadline


@pytest.mark.parametrize("local_mode", [True, False], ids=["local", "distributed"])
def test_a_rank_that_fails_stays_the_cause_when_a_peer_waits_in_report(
    local_mode: bool, spark_session: Any, tmp_path: Path, no_leftovers: None
) -> None:
    """Rank 1 raises while rank 0 waits in report(): the error leads with rank 1's exception,
    not with the report() error rank 0 gets because rank 1 ended."""
    d = Distributor(
        num_processes=2,
        local_mode=local_mode,
        spark=None if local_mode else spark_session,
        storage_path=tmp_path,
        timeout=120,
        log_ranks=[],
    )
    with pytest.raises(DistributedRunError) as caught:
        d.run(report_then_fail_on_rank_1)
    assert caught.value.rank == 1 and str(caught.value).startswith("rank 1 on "), str(caught.value)
    assert "ValueError: the real problem of rank 1" in str(caught.value).splitlines()[0]


def test_best_checkpoints_by_score_and_opening_a_past_run(tmp_path: Path, no_leftovers: None) -> None:
    """keep_checkpoints with a score keeps the best N (and the latest, to resume from);
    best_checkpoints lists them best first with their metrics; RunResult.from_path() opens the run later."""
    from spark_torch import Checkpoint, RunResult

    scores = [0.2, 0.9, 0.1, 0.7, 0.3]
    d = Distributor(num_processes=2, storage_path=tmp_path, keep_checkpoints=2, checkpoint_score_attribute="score")
    d.run(report_scores, scores)
    result = d.last_run
    assert result is not None and result.checkpoint is not None and result.checkpoint.step == 5
    best = [(c.step, m["score"]) for c, m in result.best_checkpoints]
    assert best == [(2, 0.9), (4, 0.7), (5, 0.3)]  # the 2 best, and the latest
    assert sorted(p.name for p in (tmp_path / result.run_id).glob("checkpoint_*")) == [
        "checkpoint_000002",
        "checkpoint_000004",
        "checkpoint_000005",
    ]
    top, metrics = result.best_checkpoints[0]
    assert isinstance(top, Checkpoint) and Path(top.to_directory(tmp_path / "best"), "score.txt").read_text() == "0.9"
    past = RunResult.from_path(
        tmp_path, result.run_id, checkpoint_score_attribute="score", checkpoint_score_order="min"
    )
    assert [c.step for c, _ in past.best_checkpoints] == [5, 4, 2] and past.value is None
    assert past.metrics_dataframe["score"].tolist() == scores and past.metrics["step"] == 5
    with pytest.raises(FileNotFoundError, match="no run 'nope' under"):
        RunResult.from_path(tmp_path, "nope")
    with pytest.raises(ValueError, match="checkpoint_score_order must be 'max' or 'min'"):
        Distributor(checkpoint_score_order="best")


def test_unlimited_restarts(no_leftovers: None) -> None:
    d = Distributor(num_processes=2, max_restarts=-1)
    assert d.run(fail_first_attempts, 3) == 3
    assert d.last_run is not None and d.last_run.restarts == 3
    with pytest.raises(ValueError, match="max_restarts must be >= -1"):
        Distributor(max_restarts=-2)


def test_concurrent_runs_on_one_instance_keep_their_own_results(tmp_path: Path, no_leftovers: None) -> None:
    """Two threads call run() on the same Distributor at once: each thread's last_run is its own."""
    import threading

    d = Distributor(num_processes=1, storage_path=tmp_path)
    seen: dict[int, tuple[Any, Any]] = {}

    def call(count: int) -> None:
        value = d.run(report_steps, count)
        assert d.last_run is not None
        seen[count] = (value, [row["i"] for row in d.last_run.rows])

    threads = [threading.Thread(target=call, args=(n,)) for n in (2, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert seen == {2: (2, [0, 1]), 5: (5, [0, 1, 2, 3, 4])}


def test_dbfs_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_leftovers: None) -> None:
    """dbfs:/ is the /dbfs mount where Databricks has it; elsewhere fsspec's Databricks
    filesystem, which needs credentials: one ConfigurationError naming the URL and the fix
    (it was a raw TypeError, or a local directory named "dbfs:")."""
    import spark_torch.reporting.storage_urls as storage

    mount = tmp_path / "dbfs"
    mount.mkdir()
    monkeypatch.setattr(storage, "DBFS_MOUNT", str(mount))
    d = Distributor(num_processes=2, storage_path="dbfs:/team/runs")
    d.run(report_scores, [0.5])
    assert d.last_run is not None and d.last_run.checkpoint is not None
    assert d.last_run.checkpoint.path == str(mount / "team" / "runs" / d.last_run.run_id / "checkpoint_000001")
    monkeypatch.setattr(storage, "DBFS_MOUNT", str(tmp_path / "no-mount"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        ConfigurationError,
        match=r"storage dbfs://team/runs/\w+ cannot be used \(TypeError: .*'instance' and 'token'.*\{'instance': \.\.\., 'token': \.\.\.\}",
    ):
        Distributor(storage_path="dbfs:/team/runs").run(report_steps, 0)
    assert not (tmp_path / "dbfs:").exists()
