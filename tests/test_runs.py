"""Past runs: list_runs()/RunSummary and ``spark-torch runs`` / ``runs show`` over real runs
that reported (local mode, storage in tmp_path); the command as a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import spark_torch
from spark_torch import DistributedRunError, Distributor, RunTimeoutError
from spark_torch.reporting.run_log import Outcome

from .conftest import SCRIPTS
from .ray_train_programs import report_losses

CLI = [sys.executable, "-m", "spark_torch"]


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120, env=dict(os.environ))


@pytest.fixture(scope="module")
def storage(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two runs: "steady" (2 ranks, 3 steps, one attempt, then resumed by a second run() call
    that adds a step) and "restarted" (1 rank, whose first attempt fails after one step)."""
    base = tmp_path_factory.mktemp("runs")
    Distributor(num_processes=2, storage_path=base, run_id="steady", log_ranks=[]).run(report_losses, [0.9, 0.4, 0.6])
    Distributor(num_processes=1, storage_path=base, run_id="restarted", max_restarts=1, log_ranks=[]).run(
        report_losses, [0.8, 0.3], fail_attempts=1
    )
    Distributor(num_processes=2, storage_path=base, run_id="steady", log_ranks=[]).run(
        report_losses, [0.9, 0.4, 0.6, 0.5]
    )
    return base


def test_list_runs(storage: Path) -> None:
    runs = spark_torch.list_runs(storage, checkpoint_score_attribute="loss", checkpoint_score_order="min")
    assert [r.run_id for r in runs] == ["restarted", "steady"]  # newest start first
    restarted, steady = runs
    assert restarted.attempts == 2 and restarted.world_size == 1 and restarted.steps == 2
    assert [row["attempt"] for row in restarted.attempt_log] == [0, 1]
    assert restarted.metrics["loss"] == 0.3 and restarted.metrics["step"] == 2
    assert restarted.best_checkpoint is not None and restarted.best_checkpoint.step == 2
    assert restarted.path == str(storage / "restarted")
    assert steady.attempts == 2 and [row["attempt"] for row in steady.attempt_log] == [
        0,
        1,
    ]  # two run() calls number on
    assert steady.world_size == 2 and steady.steps == 4 and steady.metrics["loss"] == 0.5
    assert steady.best_checkpoint is not None and steady.best_checkpoint.step == 2  # loss 0.4, the lowest
    assert steady.checkpoint is not None and steady.checkpoint.step == 4
    assert steady.started is not None and restarted.started is not None and steady.started < restarted.started
    newest = spark_torch.list_runs(storage)[1].best_checkpoint  # without a score: the latest
    assert newest is not None and newest.step == 4
    assert spark_torch.list_runs(storage / "no-such-storage") == []


def test_cli_runs_lists_the_runs(storage: Path) -> None:
    done = cli("runs", str(storage), "--checkpoint-score", "loss:min")
    assert done.returncode == 0, done.stderr
    header, first, second = done.stdout.splitlines()
    assert header.split()[:8] == ["RUN", "ID", "STARTED", "DURATION", "OUTCOME", "ENTRY", "ATTEMPTS", "WORLD"]
    assert header.endswith("CHECKPOINT (BEST BY SCORE, ELSE LATEST)")
    assert first.split()[0] == "restarted" and first.split()[4:9] == [
        "succeeded",
        "tests.ray_train_programs.report_losses",
        "2",
        "1",
        "2",
    ]  # attempts, world, steps
    assert "loss=0.3" in first and first.endswith(f"{storage / 'restarted' / 'checkpoint_000002'} (best: lowest loss)")
    assert second.split()[0] == "steady" and second.split()[6:9] == ["2", "2", "4"]
    assert second.endswith(f"{storage / 'steady' / 'checkpoint_000002'} (best: lowest loss)")
    unscored = cli("runs", str(storage)).stdout.splitlines()  # these runs had no score: their latest
    assert unscored[2].endswith(f"{storage / 'steady' / 'checkpoint_000004'} (latest)")
    listed = json.loads(cli("runs", str(storage), "--json").stdout)
    assert [r["run_id"] for r in listed] == ["restarted", "steady"] and listed[1]["checkpoint"]["step"] == 4


def test_cli_runs_show(storage: Path) -> None:
    done = cli("runs", "show", "restarted", "--storage", str(storage))
    assert done.returncode == 0, done.stderr
    text = done.stdout
    assert text.startswith("run restarted\n") and f"path             {storage / 'restarted'}" in text
    assert (
        "  outcome          succeeded\n" in text
        and "  entry            tests.ray_train_programs.report_losses\n" in text
    )
    assert "attempt 0: 1 rank(s) on 1 node(s), start; failed: rank 0 on " in text
    assert "attempt 1: 1 rank(s) on 1 node(s), restart after a failure; succeeded" in text
    assert (
        "checkpoints (2, latest first):" in text
        and "step 2  " + str(storage / "restarted" / "checkpoint_000002") in text
    )
    assert f"  best checkpoint  {storage / 'restarted' / 'checkpoint_000002'} (latest)" in text
    scored = cli("runs", "show", "steady", "--storage", str(storage), "--checkpoint-score", "loss:min").stdout
    assert "checkpoints (4, best first: lowest loss first):" in scored
    shown = json.loads(cli("runs", "show", "steady", "--storage", str(storage), "--json").stdout)
    assert [row["step"] for row in shown["history"]] == [1, 2, 3, 4] and len(shown["checkpoints"]) == 4


@pytest.mark.parametrize("order", ["min", "max"])
def test_a_past_run_orders_its_checkpoints_as_last_run_did(order: str, tmp_path: Path, no_leftovers: None) -> None:
    """The run's checkpoint_score_attribute and order are stored with it: RunResult.from_path,
    list_runs and ``spark-torch runs`` (show) order its checkpoints as last_run did, under a
    heading that says the order; an explicit score still overrides."""
    losses = [0.5, 0.2, 0.9, 0.4]
    d = Distributor(
        num_processes=1,
        storage_path=tmp_path,
        run_id="scored",
        checkpoint_score_attribute="loss",
        checkpoint_score_order=order,
        log_ranks=[],
    )
    d.run(report_losses, losses)
    assert d.last_run is not None
    then = [c.step for c, _ in d.last_run.best_checkpoints]
    assert then == ([2, 4, 1, 3] if order == "min" else [3, 1, 4, 2])
    past = spark_torch.RunResult.from_path(tmp_path / "scored")
    assert [c.step for c, _ in past.best_checkpoints] == then
    (summary,) = spark_torch.list_runs(tmp_path)
    assert summary.best_checkpoint is not None and summary.best_checkpoint.step == then[0]
    assert (summary.checkpoint_score_attribute, summary.checkpoint_score_order) == ("loss", order)
    side = "lowest" if order == "min" else "highest"
    shown = cli("runs", "show", "scored", "--storage", str(tmp_path))
    assert shown.returncode == 0, shown.stderr
    assert f"checkpoints (4, best first: {side} loss first):" in shown.stdout
    listed = [line.split()[1] for line in shown.stdout.splitlines() if line.startswith("  step ")]
    assert listed == [str(step) for step in then]
    assert cli("runs", str(tmp_path)).stdout.splitlines()[1].endswith(f"checkpoint_{then[0]:06d} (best: {side} loss)")
    latest = spark_torch.RunResult.from_path(
        tmp_path / "scored",
        checkpoint_score_attribute="loss",
        checkpoint_score_order="max" if order == "min" else "min",
    )
    assert [c.step for c, _ in latest.best_checkpoints] == then[::-1]


def test_a_script_that_never_reports_is_kept_with_its_outcome_and_attempts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_leftovers: None
) -> None:
    """An unchanged torchrun-style script (no report()) in the default storage, restarted once
    and failing twice: its directory stays (``last_run.path``), and list_runs, ``runs``, ``runs
    show`` and RunResult.from_path say what it ran, how it ended, each attempt's end and reason."""
    monkeypatch.setenv("HOME", str(tmp_path))  # the default storage, ~/spark_torch_runs, in tmp_path
    script = str(SCRIPTS / "exit_code.py")
    d = Distributor(num_processes=2, max_restarts=1, log_ranks=[])
    with pytest.raises(DistributedRunError):
        d.run(script, 3, 1)
    last = d.last_run
    assert (
        last is not None and last.path == str(tmp_path / "spark_torch_runs" / last.run_id) and os.path.isdir(last.path)
    )
    assert last.outcome is Outcome.FAILED and last.entry == f"{script} 3 1"
    assert last.duration is not None and last.duration > 0 and last.started is not None
    (summary,) = spark_torch.list_runs()
    assert (summary.run_id, summary.outcome, summary.entry, summary.attempts) == (
        last.run_id,
        Outcome.FAILED,
        f"{script} 3 1",
        2,
    )
    assert summary.error is not None and summary.error.startswith("DistributedRunError: rank 1 on ")
    (call,) = summary.calls
    assert [(a.attempt, a.reason, a.end) for a in call.attempts] == [
        (0, "start", "failed"),
        (1, "restart after a failure", "failed"),
    ]
    assert all(a.error is not None and "exited with code 3" in a.error for a in call.attempts)
    past = spark_torch.RunResult.from_path(last.path)
    assert (past.outcome, past.entry, past.started, past.restarts) == (Outcome.FAILED, last.entry, last.started, 1)
    assert past.error_line == summary.error and past.duration is not None
    assert [(str(a.reason), str(a.end)) for a in past.attempts] == [
        ("start", "failed"),
        ("restart after a failure", "failed"),
    ]
    assert "outcome='failed'" in repr(past) and "error='DistributedRunError: rank 1 on " in repr(past)
    shown = cli("runs", "show", last.run_id)
    assert shown.returncode == 0, shown.stderr
    assert f"  entry            {script} 3 1\n" in shown.stdout
    assert "  outcome          failed: DistributedRunError: rank 1 on " in shown.stdout
    assert "attempt 1: 2 rank(s) on 1 node(s), restart after a failure; failed: rank 1 on " in shown.stdout
    listed = cli("runs").stdout.splitlines()
    assert (
        len(listed) == 2 and listed[1].startswith(last.run_id) and " failed: DistributedRunError: rank 1" in listed[1]
    )


def test_a_distributed_run_stopped_by_its_timeout_is_listed_so(
    spark_session: Any, tmp_path: Path, no_leftovers: None
) -> None:
    """Distributed mode: a hanging script stopped by ``timeout`` is kept, "stopped by timeout"."""
    d = Distributor(
        num_processes=2, local_mode=False, spark=spark_session, timeout=5, storage_path=tmp_path, log_ranks=[]
    )
    with pytest.raises(RunTimeoutError):
        d.run(str(SCRIPTS / "hang.py"))
    assert d.last_run is not None and d.last_run.outcome is Outcome.TIMED_OUT and os.path.isdir(str(d.last_run.path))
    (summary,) = spark_torch.list_runs(tmp_path)
    assert summary.outcome is Outcome.TIMED_OUT and summary.entry == str(SCRIPTS / "hang.py")
    assert summary.error is not None and summary.error.startswith("RunTimeoutError: ")
    assert [a.end for a in summary.calls[0].attempts] == ["timed out"]
    assert " stopped by timeout " in cli("runs", str(tmp_path)).stdout.splitlines()[1]


def test_the_cli_page_says_what_runs_prints() -> None:
    """docs/cli.md's `runs` section: the table's column and the show headings are the ones the
    code prints (never "best first" for a run ordered latest first)."""
    from spark_torch.driver.api.past_runs import RunSummary, run_details, runs_table

    root = Path(__file__).resolve().parent.parent
    section = (root / "docs" / "cli.md").read_text(encoding="utf-8").split("## Past runs: `runs`")[1].split("\n## ")[0]
    text = " ".join(section.split())
    checkpoint = spark_torch.Checkpoint("/tmp/runs/steady/checkpoint_000002", step=2, metrics={"loss": 0.4})

    def summary(score: str | None) -> RunSummary:
        return RunSummary(
            "steady", "/tmp/runs/steady", 0.0, 1, 2, 3, {"loss": 0.6}, checkpoint, checkpoint, [], score, "min"
        )

    scored, latest = run_details(summary("loss"), [checkpoint] * 4), run_details(summary(None), [checkpoint] * 4)
    assert (
        "checkpoints (4, best first: lowest loss first):" in scored
        and "`checkpoints (4, best first: lowest loss first):`" in text
    )
    assert "checkpoints (4, latest first):" in latest and "`checkpoints (4, latest first):`" in text
    header, row = runs_table([summary("loss")]).splitlines()
    assert header.split("LAST METRICS")[1].strip() in section and row.endswith("checkpoint_000002 (best: lowest loss)")
    assert "checkpoint_000002 (best: lowest loss)" in section and "`(latest)`" in text


def test_cli_runs_errors(storage: Path, tmp_path: Path) -> None:
    missing = cli("runs", "show", "nope", "--storage", str(storage))
    assert missing.returncode == 2 and missing.stderr.startswith(f"spark-torch: error: no run 'nope' under {storage}")
    assert "Traceback" not in missing.stderr
    usage = cli("runs", "show")
    assert usage.returncode == 2 and "give one STORAGE to list, or show RUN_ID" in usage.stderr
    twice = cli("runs", str(storage), "--storage", str(storage))
    assert twice.returncode == 2 and "give the storage once" in twice.stderr
    empty = cli("runs", str(tmp_path))
    assert empty.returncode == 0 and empty.stdout == "" and f"no runs in {tmp_path}" in empty.stderr
    bad_score = cli("runs", str(storage), "--checkpoint-score", "loss:lowest")
    assert bad_score.returncode == 2 and "write METRIC, METRIC:max or METRIC:min" in bad_score.stderr


def test_a_run_without_an_attempt_log(storage: Path, tmp_path: Path) -> None:
    """A run written before attempts were recorded: its start is its first report, its
    attempts unknown (``-`` in the table)."""
    import shutil

    shutil.copytree(storage / "restarted", tmp_path / "old")
    (tmp_path / "old" / "attempts.jsonl").unlink()
    (tmp_path / "old" / "run.jsonl").unlink()  # nor its calls
    (old,) = spark_torch.list_runs(tmp_path)
    first_row = json.loads((tmp_path / "old" / "metrics.jsonl").read_text().splitlines()[0])
    assert old.attempts is None and old.attempt_log == [] and old.started == first_row["time"]
    assert old.world_size == 1 and old.steps == 2
    line = cli("runs", str(tmp_path)).stdout.splitlines()[1]
    assert line.split()[0] == "old" and line.split()[3:9] == [
        "-",
        "-",
        "-",
        "-",
        "1",
        "2",
    ]  # duration, outcome, entry, attempts


def test_a_run_is_one_replica_group_only_beside_its_sibling_groups() -> None:
    """`runs` names a run RUN_ID-gN one group of RUN_ID when RUN_ID-g0 ... RUN_ID-gN (two at least)
    are stored; a run the user named x-g0 alone, or x-g2 without x-g1, is listed as named."""
    from spark_torch.driver.api.past_runs import RunSummary, _with_group

    def group_of(run_id: str, stored: set[str]) -> tuple[str | None, int | None]:
        summary = _with_group(RunSummary(run_id, f"/runs/{run_id}", None, None, None, 0, {}, None, None), stored)
        return summary.replica_run, summary.replica_group

    assert group_of("exp-g1", {"exp-g0", "exp-g1"}) == ("exp", 1)
    assert group_of("exp-g0", {"exp-g0", "exp-g1"}) == ("exp", 0)
    assert group_of("a-b-g10", {f"a-b-g{n}" for n in range(11)}) == ("a-b", 10)
    assert group_of("exp-g0", {"exp-g0"}) == (None, None)
    assert group_of("exp-g2", {"exp-g0", "exp-g2"}) == (None, None)
    assert group_of("exp-g01", {"exp-g0", "exp-g01"}) == (None, None)
    assert group_of("steady", {"steady"}) == (None, None)
