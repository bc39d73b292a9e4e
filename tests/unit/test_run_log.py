"""The run's log (what each run() call ran and how it and its attempts ended), the retention of
runs that reported nothing, a RunResult's short repr, a call's outcome from its end, and a replica-group
run's restarts counted one way."""

from __future__ import annotations

from pathlib import Path

import pytest

from spark_torch.base.states import StopReason
from spark_torch.driver.result import AttemptEnd, AttemptReason, AttemptRecord, RunResult
from spark_torch.driver.run.call_storage import run_outcome
from spark_torch.driver.run.cancel import RunCancelled
from spark_torch.driver.run.outcome import AttemptOutcome, DriverStop, Interrupted, RanksFailed, RanksStopped
from spark_torch.errors import DistributedRunError, RunStalledError, RunTimeoutError
from spark_torch.reporting.run_log import Outcome, attempt_row, call_row, end_row, prune_unreported, read_calls
from spark_torch.reporting.storage import RUN_LOG, RunStorage


def test_a_call_its_attempts_and_its_end_read_back() -> None:
    rows = [
        call_row("train.py", "script", ["--lr", "0.1"], started=100.0),
        attempt_row(0, 2, 1, "start", "failed", ("DistributedRunError", "rank 1 on h failed"), "", 101.0),
        attempt_row(1, 2, 1, "restart after a failure", "succeeded", None, "", 103.0),
        end_row(Outcome.SUCCEEDED, None, 104.5),
        call_row("train", "function", started=200.0),  # a later call: its driver died, no end
        {"event": "a newer kind", "time": 201.0},
    ]
    first, second = read_calls(rows)
    assert (first.entry, first.kind, first.outcome, first.duration, first.error) == (
        "train.py --lr 0.1",
        "script",
        Outcome.SUCCEEDED,
        4.5,
        None,
    )
    assert [str(a) for a in first.attempts] == [
        "attempt 0: 2 rank(s) on 1 node(s), start; failed: rank 1 on h failed",
        "attempt 1: 2 rank(s) on 1 node(s), restart after a failure; succeeded",
    ]
    assert (second.outcome, second.ended, second.duration, second.attempts) == (Outcome.NO_END, None, None, ())


def test_an_end_names_the_error_by_its_first_line() -> None:
    row = end_row(Outcome.FAILED, ValueError("bad lr\nmore detail"), 1.0)
    assert row["error"] == "ValueError: bad lr" and row["outcome"] == "failed"
    assert read_calls([call_row("f", "function", started=0.0), row])[0].error == "ValueError: bad lr"
    assert "error" not in end_row(Outcome.SUCCEEDED, None, 1.0)


STOPPED = AttemptOutcome.ended(RanksStopped(5.0, (), "no rank was running"))
CANCELLED = RunCancelled("stopped: replica group 1 failed the run")


@pytest.mark.parametrize(
    ("error", "last", "outcome"),
    [
        (None, AttemptOutcome.succeeded(None), Outcome.SUCCEEDED),
        (DistributedRunError([], headline="rank 0 failed"), AttemptOutcome.ended(RanksFailed(())), Outcome.FAILED),
        (RunTimeoutError([], headline="timeout"), STOPPED, Outcome.TIMED_OUT),
        (
            RunStalledError([], headline="stalled"),
            AttemptOutcome.ended(DriverStop(StopReason.STALLED, "stalled")),
            Outcome.STALLED,
        ),
        (KeyboardInterrupt(), AttemptOutcome.ended(Interrupted(KeyboardInterrupt())), Outcome.INTERRUPTED),
        (KeyboardInterrupt(), None, Outcome.INTERRUPTED),  # Ctrl-C before the first attempt (or between two)
        (ValueError("bad option"), None, Outcome.FAILED),  # raised before any attempt
        (CANCELLED, AttemptOutcome.ended(Interrupted(CANCELLED)), Outcome.FAILED),  # another group failed the run
        (DistributedRunError([], headline="cannot unpickle"), AttemptOutcome.succeeded(None), Outcome.FAILED),
        # the end is the attempt's, whatever the type of the error it became
        (DistributedRunError([], headline="stopped"), STOPPED, Outcome.TIMED_OUT),
    ],
    ids=[f"end-{n}" for n in range(10)],
)
def test_a_calls_outcome_is_its_last_attempts(
    error: BaseException | None, last: AttemptOutcome | None, outcome: Outcome
) -> None:
    assert run_outcome(error, last) is outcome


def _run(base: Path, run_id: str, started: float, *, ended: bool = True, reported: bool = False) -> None:
    storage = RunStorage(str(base), run_id, {})
    storage.create("token")
    storage.append_log(RUN_LOG, call_row("train", "function", started=started))
    if ended:
        storage.append_log(RUN_LOG, end_row(Outcome.SUCCEEDED, None, started + 1))
    if reported:
        storage.append_metrics({"step": 1, "loss": 0.5})


def test_retention_keeps_the_newest_runs_that_reported_nothing(tmp_path: Path) -> None:
    for index in range(6):
        _run(tmp_path, f"quiet{index}", float(index))
    _run(tmp_path, "reported", 0.0, reported=True)  # reported: kept, whatever its age
    _run(tmp_path, "running", -1.0, ended=False)  # no end yet (or its driver died): kept
    removed = prune_unreported(str(tmp_path), {}, keep=3, spare="quiet0")  # quiet0: the run that just ended
    assert sorted(removed) == ["quiet1", "quiet2", "quiet3"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["quiet0", "quiet4", "quiet5", "reported", "running"]


def test_retention_reads_no_metrics_and_keeps_checkpointed_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every run() of the default storage prunes it: a run that reported is told by one listing,
    its metrics (which grow with its steps) never read; a run with only a checkpoint is kept too."""
    for index in range(3):
        _run(tmp_path, f"quiet{index}", float(index))
    _run(tmp_path, "reported", 0.0, reported=True)
    _run(tmp_path, "checkpointed", 0.0)
    (tmp_path / "checkpointed" / "checkpoint_000001").mkdir()
    monkeypatch.setattr(RunStorage, "history", lambda self: pytest.fail("prune read a run's metrics"))
    assert sorted(prune_unreported(str(tmp_path), {}, keep=1)) == ["quiet0", "quiet1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpointed", "quiet2", "reported"]


def test_a_results_repr_is_short_whatever_its_value() -> None:
    state = {f"layer{i}.weight": list(range(100)) for i in range(40)}
    text = repr(RunResult(run_id="abc", value=state, outcome=Outcome.SUCCEEDED, path="/runs/abc"))
    assert (
        text
        == "RunResult(run_id='abc', outcome='succeeded', value=<dict, 40 items>, steps=0, restarts=0, path='/runs/abc')"
    )
    assert "value=<str, 5 characters>" in repr(RunResult(run_id="a", value="hello"))
    assert "value=<int>" in repr(RunResult(run_id="a", value=7))
    failed = repr(RunResult(run_id="a", error=ValueError("x" * 500 + "\nsecond")))
    assert "error='ValueError: xxx" in failed and "second" not in failed and len(failed) < 200


def test_a_tensor_value_shows_its_shape() -> None:
    torch = pytest.importorskip("torch")
    assert "value=<Tensor, shape (3, 4)>" in repr(RunResult(run_id="a", value=torch.zeros(3, 4)))


def test_the_docs_state_the_retention_bound() -> None:
    from spark_torch.reporting.run_log import KEEP_UNREPORTED_RUNS

    text = " ".join((Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text(encoding="utf-8").split())
    assert f"nothing (no metrics, no checkpoint) are bounded: the newest {KEEP_UNREPORTED_RUNS} are kept" in text


def test_a_replica_group_runs_restarts_are_each_groups_own_calls() -> None:
    """One merge rule for a call's last_run and a past run (merge_groups): the run's restarts are
    its groups' restarts, each as the group's own call counts them (its attempts after the
    first), never its attempts across earlier run() calls that resumed the run_id."""
    from spark_torch.driver.result import merge_groups

    def attempt(index: int) -> AttemptRecord:
        return AttemptRecord(index, 1, 1, AttemptReason.START, end=AttemptEnd.SUCCEEDED)

    # group 0: an earlier call's attempt, then this call's one; group 1: an earlier call's, then this call's two
    parts = {
        0: RunResult(run_id="r-g0", attempts=[attempt(0), attempt(1)], restarts=0, outcome=Outcome.SUCCEEDED),
        1: RunResult(run_id="r-g1", attempts=[attempt(0), attempt(1), attempt(2)], restarts=1, outcome=Outcome.FAILED),
    }
    merged = merge_groups("r", parts, None)
    assert merged.restarts == 1
    assert [a.replica_group for a in merged.attempts] == [0, 0, 1, 1, 1]
    assert merged.outcome is Outcome.FAILED and [p.run_id for p in merged.replica_groups] == ["r-g0", "r-g1"]
    # what the call knows itself overrides the shown group's (Ctrl-C)
    assert merge_groups("r", parts, None, outcome=Outcome.INTERRUPTED).outcome is Outcome.INTERRUPTED
