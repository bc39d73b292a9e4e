"""replica_groups end to end in local mode (real torchft ranks on gloo, the lighthouse on the
driver, loopback): a group whose rank is SIGKILLed mid-step restarts alone and heals from its
peer while the other keeps its process and never goes back in steps; a group over its budget
fails the run and the other group is stopped; nothing is left listening or running. Kill points
are step counts and files (tests/ft_programs.py), never timing; torchft's timeouts are small."""

from __future__ import annotations

import ast
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import psutil
import pytest

from spark_torch import Distributor, ReplicaGroupError, RunResult, RunTimeoutError, list_runs
from spark_torch.driver.result import AttemptEnd
from tests import ft_programs
from tests.outsiders import torchft_hello

pytest.importorskip("torchft")

#: a lost group leaves the quorum as spark_torch's defaults say (0.3 s without heartbeats); a late or
#: restarted group joins within 0.5 s
FAST = {"min_replicas": 1, "join_timeout_ms": 500}


def _options() -> object:
    from spark_torch.ft.lighthouse import LighthouseOptions

    return LighthouseOptions(**FAST)


def _steps(path: Path) -> list[tuple[int, int]]:
    """The ``PID STEP`` lines a group's ranks wrote, in order."""
    return [(int(pid), int(step)) for pid, step in (line.split() for line in path.read_text().splitlines())]


def _listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def _reported(result: RunResult | None, work: Path) -> None:
    """The run's history as ``last_run`` shows it: every group's rows, each naming its group, each
    committed step (torchft's, as the ranks logged it) once per group, in step order."""
    assert result is not None
    rows = [(row["replica_group"], row["step"]) for row in result.history]
    assert len(rows) == len(set(rows)) and rows == sorted(rows, key=lambda gs: (gs[1], gs[0])), rows
    for group in (0, 1):
        committed = sorted({step for _, step in _steps(work / f"g{group}.steps")})
        assert [step for g, step in rows if g == group] == committed, (group, rows)
    assert [r.run_id for r in result.replica_groups] == [f"{result.run_id}-g0", f"{result.run_id}-g1"]


def _killed_group_healed_alone(tmp_path: Path, weights: list[float], rank: str = "") -> tuple[set[int], int]:
    """The other group kept its one process and its committed steps only went forward; group 1
    ran twice, its second process starting past its first's last step; group 1 ended with the
    weights run() returned. Returns group 0's committed steps and group 1's first after the restart.
    ``rank`` ("r1"): of that rank of each group, in groups of several ranks."""
    survivor, killed = _steps(tmp_path / f"g0{rank}.steps"), _steps(tmp_path / f"g1{rank}.steps")
    assert len({pid for pid, _ in survivor}) == 1, survivor[:5]
    assert [step for _, step in survivor] == sorted({step for _, step in survivor})
    pids = list(dict.fromkeys(pid for pid, _ in killed))
    assert len(pids) == 2 and (tmp_path / "killed1").exists(), pids
    before = [step for pid, step in killed if pid == pids[0]]
    after = [step for pid, step in killed if pid == pids[1]]
    assert after[0] > before[-1] >= 1, (before[-3:], after[:3])
    assert ast.literal_eval((tmp_path / f"g1{rank}.weights").read_text()) == weights
    return {step for _, step in survivor}, after[0]


def test_a_killed_group_restarts_alone_and_heals_from_its_peer(
    tmp_path: Path, no_leftovers: None, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("RUST_LOG", raising=False)
    distributor = Distributor(
        num_processes=2,
        replica_groups=2,
        max_restarts=1,
        lighthouse_options=_options(),
        timeout=240,
        log_ranks=[],
        storage_path=tmp_path / "runs",
    )
    weights = distributor.run(ft_programs.train, 5, str(tmp_path), 1, 2)
    survivor, restarted_at = _killed_group_healed_alone(tmp_path, weights)
    assert restarted_at in survivor  # the killed group's second process started from its peer's step, not from 0
    # both end with the same weights, and run() returned group 0's
    assert ast.literal_eval((tmp_path / "g0.weights").read_text()) == weights
    # every listener of the ranks (torchft's Manager server and gloo's included) is on loopback
    for group in (0, 1):
        assert ast.literal_eval((tmp_path / f"g{group}.listening").read_text()) in ([], ["127.0.0.1"])
    # last_run is the whole run: each group's rows name it, the healed group reported no step twice
    last = distributor.last_run
    assert last is not None and last.error is None and not last.run_id.endswith("-g0")
    _reported(last, tmp_path)
    assert [(a.replica_group, a.end) for a in last.attempts] == [
        (0, AttemptEnd.SUCCEEDED),
        (1, AttemptEnd.FAILED),
        (1, AttemptEnd.SUCCEEDED),
    ]
    assert str(last.attempts[1]).startswith("replica group 1: ") and last.restarts == 1
    # each group's own run counts its restarts, and a restart's attempt is labelled one
    assert [r.restarts for r in last.replica_groups] == [0, 1]
    assert [a.attempt for a in last.replica_groups[1].attempts] == [0, 1]
    # the restarted group's ranks see their restart, as under torchrun (it was 0 again)
    for group, counts in ((0, ["0"]), (1, ["0", "1"])):
        assert [line.split()[1] for line in (tmp_path / f"g{group}.restarts").read_text().splitlines()] == counts
    reasons = [(a.replica_group, str(a.reason)) for a in last.attempts]
    assert reasons == [(0, "start"), (1, "start"), (1, "restart after a failure")], reasons
    # the run's steps: the last step committed, not the groups' rows added up
    assert last.steps == max(row["step"] for row in last.history) < len(last.history), last.history
    assert f"steps={last.steps}," in repr(last)
    _the_past_run_is_the_whole_run(tmp_path / "runs", last)
    # torchft's lighthouse logs at warning: none of its INFO lines (3 per quorum tick) on the console
    console = capfd.readouterr()
    assert "[INFO]" not in console.out + console.err, (console.out + console.err)[-2000:]


def test_an_unchanged_torchft_script_survives_a_killed_group(tmp_path: Path, no_leftovers: None) -> None:
    """torchft's example as it is (its own torchft.Manager, ProcessGroupGloo, DDP and Optimizer,
    from torchrun's variables): group 1's rank SIGKILLed mid-step; group 0 keeps its process (the
    DDP hook fix reaches a Manager the script made itself), group 1 restarts alone, and the run
    ends ok; every listener of the ranks is on loopback (the Manager's server included)."""
    distributor = Distributor(
        num_processes=2,
        replica_groups=2,
        max_restarts=1,
        lighthouse_options=_options(),
        timeout=240,
        log_ranks=[],
    )
    weights = distributor.run(ft_programs.torchft_example, 5, str(tmp_path), 1, 2)
    survivor, killed = _steps(tmp_path / "g0.steps"), _steps(tmp_path / "g1.steps")
    assert len({pid for pid, _ in survivor}) == 1, survivor[:5]  # the same process from start to end
    assert [step for _, step in survivor] == sorted({step for _, step in survivor})
    assert len(dict.fromkeys(pid for pid, _ in killed)) == 2 and (tmp_path / "killed1").exists(), killed
    assert ast.literal_eval((tmp_path / "g0.weights").read_text()) == weights
    for group in (0, 1):  # torchft's Manager server on the node's address, no HTTP heal server on every interface
        assert ast.literal_eval((tmp_path / f"g{group}.listening").read_text()) in ([], ["127.0.0.1"])
    last = distributor.last_run
    assert last is not None and last.error is None
    assert [(a.replica_group, a.end) for a in last.attempts] == [
        (0, AttemptEnd.SUCCEEDED),
        (1, AttemptEnd.FAILED),
        (1, AttemptEnd.SUCCEEDED),
    ]


def _an_outsider_is_refused(distributor: Distributor, tmp_path: Path) -> None:
    """Another user of the machine (uid 65534: tests/scripts/ft_outsider.py) runs an ordinary
    torchft Manager against every address it can learn (the lighthouse's the ranks were given,
    and any listener that answers like a lighthouse), claiming step 100000 with a state whose
    unpickling would create a marker file; the ranks train once it tried. It is refused, nothing
    it sent ran in a rank, and the run ends ok with its own state."""
    root = Path(__file__).resolve().parents[1]
    shared = Path(tempfile.mkdtemp(prefix="spark-torch-outsider-", dir="/tmp"))  # the outsider cannot enter tmp_path
    shared.chmod(0o777)
    marker = tmp_path / "the-outsiders-payload-ran"
    outsider = subprocess.Popen(
        [
            sys.executable,
            str(root / "tests" / "scripts" / "ft_outsider.py"),
            str(shared),
            str(shared),
            str(marker),
            str(os.getpid()),
        ],
        cwd=root,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        error: BaseException | None = None
        try:
            weights = distributor.run(ft_programs.train_beside_an_outsider, 4, str(tmp_path), str(shared))
        except Exception as exc:  # noqa: BLE001 - the marker is checked first
            error = exc
        (shared / "run.done").write_text("done\n")
        output, _ = outsider.communicate(timeout=240)
        tried = (shared / "outsider.txt").read_text() if (shared / "outsider.txt").exists() else ""
    finally:
        if outsider.poll() is None:
            outsider.kill()
            outsider.wait()
        shutil.rmtree(shared, ignore_errors=True)
    assert not marker.exists(), tried  # nothing the outsider sent was unpickled in a rank
    assert outsider.returncode == 0 and tried.startswith("uid 65534 found"), (error, output[-3000:])
    # torchft's client connects lazily: a refusal shows at its Manager's start or at its quorums
    assert " in a quorum " not in tried and (" refused: " in tried or " quorum failed: " in tried), tried
    assert error is None, error
    for group in (0, 1):  # the run's own state: every group ends with the weights run() returned, at its own steps
        assert ast.literal_eval((tmp_path / f"g{group}.weights").read_text()) == weights
        assert max(step for _, step in _steps(tmp_path / f"g{group}.steps")) < 1000


def test_another_user_cannot_join_the_quorum_or_run_code_in_a_rank(tmp_path: Path, no_leftovers: None) -> None:
    distributor = Distributor(
        num_processes=2,
        replica_groups=2,
        max_restarts=0,
        lighthouse_options=_options(),
        timeout=240,
        log_ranks=[],
    )
    _an_outsider_is_refused(distributor, tmp_path)


@pytest.mark.parametrize("wrapper", ["LocalSGD", "DiLoCo"])
def test_a_group_killed_in_a_local_sgd_inner_loop_heals_at_the_next_sync(
    tmp_path: Path, wrapper: str, no_leftovers: None
) -> None:
    """torchft's LocalSGD / DiLoCo (weights synced every 4 steps): group 1 SIGKILLed mid inner loop."""
    distributor = Distributor(
        num_processes=2,
        replica_groups=2,
        max_restarts=1,
        lighthouse_options=_options(),
        timeout=120,
        log_ranks=[],
        storage_path=tmp_path / "runs",
    )
    weights = distributor.run(ft_programs.local_sgd, 4, 4, str(tmp_path), 1, wrapper == "DiLoCo")
    syncs = {
        g: [tuple(map(int, line.split())) for line in (tmp_path / f"g{g}.syncs").read_text().splitlines()]
        for g in (0, 1)
    }
    # the survivor kept its one process, its committed syncs only went forward, it synced alone meanwhile
    assert len({pid for pid, _, _ in syncs[0]}) == 1 and (tmp_path / "killed1").exists(), syncs[0]
    assert [step for _, step, _ in syncs[0]] == sorted({step for _, step, _ in syncs[0]}), syncs[0]
    assert 1 in {n for _, _, n in syncs[0]}, syncs[0]
    # the killed group's second process resumed from its peer's step, not from 0
    pids = list(dict.fromkeys(pid for pid, _, _ in syncs[1]))
    assert len(pids) == 2, syncs[1]
    before, after = ([step for pid, step, _ in syncs[1] if pid == p] for p in pids)
    assert after[0] > before[-1] >= 1 and after[0] in {step for _, step, _ in syncs[0]}, syncs
    # both ended at the same final sync, taken together, with identical weights; run() returned group 0's
    assert syncs[0][-1][1:] == syncs[1][-1][1:] == (syncs[0][-1][1], 2), syncs
    assert (
        ast.literal_eval((tmp_path / "g0.weights").read_text())
        == ast.literal_eval((tmp_path / "g1.weights").read_text())
        == weights
    )
    last = distributor.last_run
    assert last is not None and last.error is None and [r.restarts for r in last.replica_groups] == [0, 1]


def test_diloco_refuses_the_async_quorum_and_says_what_to_pass(no_leftovers: None) -> None:
    """docs/fault-tolerance.md: DiLoCo needs use_async_quorum=False (torchft's own check)."""
    distributor = Distributor(
        num_processes=2, replica_groups=2, lighthouse_options=_options(), timeout=120, log_ranks=[]
    )
    with pytest.raises(ReplicaGroupError) as info:
        distributor.run(ft_programs.diloco_with_the_async_quorum)
    assert "ValueError" in str(info.value) and "use_async_quorum=False" in str(info.value), str(info.value)


def _the_past_run_is_the_whole_run(storage: Path, last: RunResult) -> None:
    """RunResult.from_path and `spark-torch runs show` open the whole run by its id (each group
    stored as RUN_ID-gN): every group's rows and attempts, as last_run had them."""
    for past in (RunResult.from_path(storage, last.run_id), RunResult.from_path(storage / last.run_id)):
        assert past.run_id == last.run_id and past.path is None
        assert [r.run_id for r in past.replica_groups] == [f"{last.run_id}-g0", f"{last.run_id}-g1"]
        assert [(row["replica_group"], row["step"]) for row in past.history] == [
            (row["replica_group"], row["step"]) for row in last.history
        ]
        assert [(a.replica_group, a.end) for a in past.attempts] == [(a.replica_group, a.end) for a in last.attempts]
        assert past.restarts == 1 and str(past.outcome) == "succeeded"
    shown = subprocess.run(
        [sys.executable, "-m", "spark_torch", "runs", "show", last.run_id, "--storage", str(storage)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shown.returncode == 0, shown.stderr
    assert (
        f"replica group 0 of run {last.run_id}" in shown.stdout
        and f"replica group 1 of run {last.run_id}" in shown.stdout
    )
    assert f"{last.run_id}-g1" in shown.stdout
    # one run() call per group: group 1's restart goes on in its call, not listed as another call
    shown = subprocess.run(
        [sys.executable, "-m", "spark_torch", "runs", "show", last.run_id, "--storage", str(storage), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shown.returncode == 0, shown.stderr
    calls = [
        [[a["reason"] for a in call["attempts"]] for call in group["calls"]]
        for group in json.loads(shown.stdout)["replica_groups"]
    ]
    assert calls == [[["start"]], [["start", "restart after a failure"]]], calls
    # each group's own run in last_run starts when its one call did (group 1's: before its restart)
    starts = [group["calls"][0]["started"] for group in json.loads(shown.stdout)["replica_groups"]]
    assert starts == [r.started for r in last.replica_groups], (starts, last.replica_groups)
    # the list: each group's run names the whole run, the groups together, group 0 first
    listed = [s for s in list_runs(storage) if s.replica_run == last.run_id]
    assert [(s.run_id, s.replica_group) for s in listed] == [(f"{last.run_id}-g0", 0), (f"{last.run_id}-g1", 1)]
    table = subprocess.run(
        [sys.executable, "-m", "spark_torch", "runs", str(storage)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert table.returncode == 0, table.stderr
    rows = [line.split("  ")[0] for line in table.stdout.splitlines()[1:]]
    assert rows[:2] == [f"{last.run_id}-g0 (replica group 0)", f"{last.run_id}-g1 (replica group 1)"], table.stdout


def test_a_rank_killed_in_a_group_of_two_restarts_its_group_alone(tmp_path: Path, no_leftovers: None) -> None:
    """Groups of two ranks (each rank a replica of the same rank of the other group): group 1's
    rank 1 SIGKILLs itself mid-step; its whole group restarts (both ranks new processes), each rank
    heals from its peer of group 0, whose two processes never changed and whose steps only went
    forward; each rank ends with the same weights as its peer."""
    distributor = Distributor(
        num_processes=4,
        replica_groups=2,
        max_restarts=1,
        lighthouse_options=_options(),
        timeout=240,
        log_ranks=[],
    )
    weights = distributor.run(ft_programs.train, 5, str(tmp_path), 1, 2, 20.0, False, 1)
    survivor, restarted_at = _killed_group_healed_alone(tmp_path, _weights(tmp_path / "g0r1.weights"), "r1")
    assert restarted_at in survivor
    # rank 0 of group 1 was not killed but restarted with its group, and healed from group 0's rank 0
    _killed_group_healed_alone(tmp_path, weights, "r0")
    assert _weights(tmp_path / "g0r0.weights") == weights  # run() returned group 0's rank 0's
    last = distributor.last_run
    assert last is not None and [(a.replica_group, a.end) for a in last.attempts] == [
        (0, AttemptEnd.SUCCEEDED),
        (1, AttemptEnd.FAILED),
        (1, AttemptEnd.SUCCEEDED),
    ]
    assert "rank 1 on " in str(last.attempts[1]), str(last.attempts[1])  # the killed rank, not its group's rank 0


def _weights(path: Path) -> list[float]:
    return list(ast.literal_eval(path.read_text()))


def test_when_every_group_dies_the_run_resumes_from_its_checkpoint(tmp_path: Path, no_leftovers: None) -> None:
    """Both groups' processes SIGKILL themselves in the same step: each group restarts from the
    newest report() checkpoint of any group, with torchft's step restored (the Manager's state is
    in it): group 1 wrote its first checkpoint only, and resumes from group 0's newer one."""
    distributor = Distributor(
        num_processes=2,
        replica_groups=2,
        max_restarts=1,
        lighthouse_options=_options(),
        timeout=240,
        log_ranks=[],
        storage_path=tmp_path / "runs",
    )
    weights = distributor.run(ft_programs.train, 4, str(tmp_path), -1, 2, 20.0, True, 0, 1)
    first_after = []
    newest = max(step for pid, step in _steps(tmp_path / "g0.steps") if pid == _steps(tmp_path / "g0.steps")[0][0])
    for group in (0, 1):
        steps = _steps(tmp_path / f"g{group}.steps")
        pids = list(dict.fromkeys(pid for pid, _ in steps))
        assert len(pids) == 2, (group, steps)
        before = [step for pid, step in steps if pid == pids[0]]
        after = [step for pid, step in steps if pid == pids[1]]
        # the new process loaded the newest checkpoint, group 0's last committed step, step and all
        # (group 1's own newest is of its first step)
        assert before[-1] == newest >= 2, (group, before[-3:], newest)
        assert _steps(tmp_path / f"g{group}.resumed") == [(pids[1], newest)]
        assert after[0] > before[-1]
        first_after.append(after[0] - before[-1])
        assert ast.literal_eval((tmp_path / f"g{group}.weights").read_text()) == weights
    assert min(first_after) == 1  # the first group back went on from the checkpoint's step, not from 0
    _reported(distributor.last_run, tmp_path)


def test_a_group_over_its_budget_fails_the_run_and_stops_the_others(tmp_path: Path, no_leftovers: None) -> None:
    """Groups of 2 ranks: group 0 trains (both its ranks commit the same steps) until group 1,
    which fails once group 0 has, is over its budget; then group 0 is stopped too."""
    distributor = Distributor(
        num_processes=4, replica_groups=2, max_restarts=0, lighthouse_options=_options(), timeout=240, log_ranks=[]
    )
    with pytest.raises(ReplicaGroupError) as info:
        distributor.run(ft_programs.fail_in_group, 1, str(tmp_path), 10**9)
    error = info.value
    assert error.group == 1 and error.rank == 0
    assert str(error).startswith(
        "replica group 1 failed 1 time, more than its max_restarts=0 allows (the other groups were stopped); "
        "its last failure: rank 0 on "
    )
    assert "RuntimeError: group 1 cannot start" in str(error)
    assert "Raise max_restarts or fix the cause" in str(error)
    assert isinstance(error.__cause__, RuntimeError)
    committed: dict[int, list[int]] = {}
    for rank in (0, 1):
        for pid, step in _steps(tmp_path / f"g0r{rank}.steps"):
            committed.setdefault(pid, []).append(step)
    assert len(committed) == 2, committed.keys()  # group 0's two ranks, one process each
    first, second = committed.values()
    shared = min(len(first), len(second))
    assert shared >= 3 and first[:shared] == second[:shared] == sorted(set(first[:shared]))


def _group_1_fails_and_stops_group_0(distributor: Distributor, work: Path) -> None:
    """Run ``fail_while_the_other_hangs``: the run's error is group 1's; group 0's hung rank is gone
    and its own run ended ``failed`` with ``RunCancelled`` (a run's timeout would say "timed out")."""
    from spark_torch.driver.run.cancel import RunCancelled
    from spark_torch.reporting.run_log import Outcome

    with pytest.raises(ReplicaGroupError) as info:
        distributor.run(ft_programs.fail_while_the_other_hangs, str(work))
    assert info.value.group == 1 and "RuntimeError: group 1 cannot start" in str(info.value)
    hung = int((work / "started-0").read_text())
    assert not psutil.pid_exists(hung) or psutil.Process(hung).status() == psutil.STATUS_ZOMBIE
    stopped = distributor.last_run.replica_groups[0] if distributor.last_run is not None else None
    assert stopped is not None and stopped.outcome is Outcome.FAILED
    assert isinstance(stopped.error, RunCancelled) and str(stopped.error) == "stopped: replica group 1 failed the run"


def test_a_failed_group_stops_the_others_whatever_their_ranks_do(tmp_path: Path, no_leftovers: None) -> None:
    """Group 0's rank hangs outside torchft, where losing the lighthouse cannot reach it; group 1
    fails past its budget: group 0's run is stopped at once (the run's error is group 1's, not
    the timeout's), its process is gone, and its own run says why it ended."""
    distributor = Distributor(
        num_processes=2, replica_groups=2, max_restarts=0, lighthouse_options=_options(), timeout=120, log_ranks=[]
    )
    _group_1_fails_and_stops_group_0(distributor, tmp_path)


def test_fewer_groups_than_min_replicas_fail_the_run_past_the_quorum_timeout(
    tmp_path: Path, no_leftovers: None
) -> None:
    """min_replicas=2 and group 1 never joins a quorum: group 0's quorum times out (torchft's
    ``quorum_timeout``, 3 s here), which fails group 0 past its budget and the run with an error
    naming it; group 1 is stopped, and nothing is left running."""
    from spark_torch.driver.run.cancel import RunCancelled
    from spark_torch.ft.lighthouse import LighthouseOptions

    options = LighthouseOptions(**{**FAST, "min_replicas": 2})
    distributor = Distributor(
        num_processes=2, replica_groups=2, max_restarts=0, lighthouse_options=options, timeout=120, log_ranks=[]
    )
    with pytest.raises(ReplicaGroupError) as info:
        distributor.run(ft_programs.train_while_group_1_hangs, str(tmp_path), 5)
    assert info.value.group == 0 and str(info.value).startswith("replica group 0 failed 1 time")
    assert "TimeoutError" in str(info.value)  # torchft's quorum wait
    stopped = distributor.last_run.replica_groups[1] if distributor.last_run is not None else None
    assert stopped is not None and isinstance(stopped.error, RunCancelled)


def test_the_timeout_stops_every_group_and_the_lighthouse(monkeypatch: pytest.MonkeyPatch, no_leftovers: None) -> None:
    import spark_torch.driver.api.replica_groups as replica_groups
    from spark_torch.ft.lighthouse import Lighthouse

    hosted: list[Lighthouse] = []

    class Recorded(Lighthouse):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]
            hosted.append(self)

    monkeypatch.setattr(replica_groups, "Lighthouse", Recorded)
    with pytest.raises(RunTimeoutError):
        Distributor(num_processes=2, replica_groups=2, max_restarts=2, timeout=5, log_ranks=[]).run(ft_programs.hang)
    assert len(hosted) == 1 and not _listening(hosted[0].port)


def test_distributed_mode_runs_a_barrier_job_per_group(
    spark_session: object, monkeypatch: pytest.MonkeyPatch, no_leftovers: None
) -> None:
    """On ``local[2]``: each group is its own barrier job (two at once) and takes a torchft step,
    its ranks reaching the lighthouse through their node's relay (on the node's loopback), which
    reaches the driver's gate on the channel's address over a connection that proved the run's
    secret; a torchft client that talks to that gate itself (from the driver's machine, as the
    driver's user) is closed, not heard. All of it stops with the run. Cold ranks
    (``warm_start=False``): the group's rank 0 hosts the group's store itself, on the executor's
    address only, like torchft's Manager server and gloo."""
    import spark_torch.driver.api.replica_groups as replica_groups
    from spark_torch.ft.lighthouse import Lighthouse

    hosted: list[tuple[Lighthouse, str]] = []

    class Recorded(Lighthouse):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]
            hosted.append((self, torchft_hello(self.address)))

    monkeypatch.setattr(replica_groups, "Lighthouse", Recorded)
    address, listening, hellos = Distributor(
        num_processes=2, local_mode=False, replica_groups=2, spark=spark_session, warm_start=False, log_ranks=[]
    ).run(ft_programs.listeners_after_a_step)
    assert listening == ["127.0.0.1"]
    # the node's relay: this user's connections from the machine get torchft's answer, from any
    # of its addresses (another user's are closed: the outsider tests)
    assert hellos == {"127.0.0.1": "answered", "127.0.0.2": "answered"}
    url = urlparse(address)
    assert url.hostname == "127.0.0.1" and url.port is not None
    assert not _listening(url.port)
    ((lighthouse, bare),) = hosted
    gate = urlparse(lighthouse.address)
    assert gate.port not in (url.port, None) and lighthouse.port not in (url.port, gate.port)
    assert bare != "joined" and not _listening(gate.port), bare


def test_another_user_cannot_join_the_quorum_in_distributed_mode(
    spark_session: object, tmp_path: Path, no_leftovers: None
) -> None:
    """On ``local[2]`` (the executors on the driver's machine, so the gate's addresses are
    theirs): another user's torchft Manager, from an executor's address, is refused as in local mode."""
    distributor = Distributor(
        num_processes=2,
        local_mode=False,
        replica_groups=2,
        spark=spark_session,
        max_restarts=0,
        lighthouse_options=_options(),
        timeout=240,
        log_ranks=[],
    )
    _an_outsider_is_refused(distributor, tmp_path)


def test_a_killed_group_restarts_alone_in_distributed_mode(
    spark_session: object, tmp_path: Path, no_leftovers: None
) -> None:
    """On ``local[2]``, each group a barrier job: group 1's rank SIGKILLed mid-step fails its job
    only; its restart is a new barrier job that heals from group 0, whose process never changed
    and whose steps only went forward; both end with the same weights and every step once."""
    distributor = Distributor(
        num_processes=2,
        local_mode=False,
        replica_groups=2,
        spark=spark_session,
        max_restarts=1,
        lighthouse_options=_options(),
        timeout=240,
        log_ranks=[],
        storage_path=tmp_path / "runs",
    )
    weights = distributor.run(ft_programs.train, 5, str(tmp_path), 1, 2)
    _killed_group_healed_alone(tmp_path, weights)
    last = distributor.last_run
    assert last is not None and last.error is None
    _reported(last, tmp_path)
    assert [(a.replica_group, a.end) for a in last.attempts] == [
        (0, AttemptEnd.SUCCEEDED),
        (1, AttemptEnd.FAILED),
        (1, AttemptEnd.SUCCEEDED),
    ]


@pytest.mark.slow
def test_a_lost_executor_costs_its_group_a_restart_on_the_replacement(
    cluster_spark: object, tmp_path: Path, no_leftovers: None
) -> None:
    """local-cluster[2,1,1024], one group per executor: group 1's rank SIGKILLs the executor JVM
    that runs it, mid-step. Group 0 keeps its process and never goes back in steps; group 1's
    barrier job fails, and its restart runs on the executor Spark starts in the lost one's place
    and heals from group 0's step (not 0); both end with the same weights."""
    from .conftest import session_executors, wait_for_slots

    wait_for_slots(cluster_spark, 2)
    before = {process.pid for process in session_executors()}
    distributor = Distributor(
        num_processes=2,
        local_mode=False,
        replica_groups=2,
        max_restarts=2,
        spark=cluster_spark,
        lighthouse_options=_options(),
        timeout=240,
        log_ranks=[],
        warm_start=False,  # the rank under its executor's JVM: a warm template may have outlived an earlier executor
    )
    weights = distributor.run(ft_programs.train, 12, str(tmp_path), kill_group=1, kill_step=3, lose_executor=True)
    survivor, first_after = _killed_group_healed_alone(tmp_path, weights)
    assert first_after > 1 and max(survivor) >= first_after
    after = {process.pid for process in session_executors()}
    assert len(before) == 2 and len(before - after) == 1 and len(after - before) == 1  # one JVM lost, one new
    wait_for_slots(cluster_spark, 2)  # the replacement serves the next tests too


def test_a_failed_group_stops_the_others_in_distributed_mode(
    spark_session: object, tmp_path: Path, no_leftovers: None
) -> None:
    """As in local mode: group 0's barrier job, whose rank hangs outside torchft, is stopped as
    soon as group 1 fails past its budget (not at the run's timeout), and its rank is gone."""
    distributor = Distributor(
        num_processes=2,
        local_mode=False,
        replica_groups=2,
        max_restarts=0,
        spark=spark_session,
        lighthouse_options=_options(),
        timeout=120,
        log_ranks=[],
    )
    _group_1_fails_and_stops_group_0(distributor, tmp_path)


@pytest.mark.slow
def test_groups_of_two_nodes_in_distributed_mode(local4_spark: object, tmp_path: Path, no_leftovers: None) -> None:
    """On ``local[4]``, two groups of two nodes (a barrier job of two tasks each, one rank per
    task): the rank of group 1's second node SIGKILLs itself mid-step; group 1's job fails and its
    restart is a new job of both nodes, each rank healing from its peer of group 0, whose two
    processes never changed; each rank of the group saw its node's rank and the group's world."""
    distributor = Distributor(
        num_processes=4,
        local_mode=False,
        replica_groups=2,
        spark=local4_spark,
        max_restarts=1,
        lighthouse_options=_options(),
        timeout=240,
        log_ranks=[],
        storage_path=tmp_path / "runs",
    )
    weights = distributor.run(ft_programs.train, 5, str(tmp_path), 1, 2, 20.0, False, 1)
    survivor, restarted_at = _killed_group_healed_alone(tmp_path, _weights(tmp_path / "g0r1.weights"), "r1")
    assert restarted_at in survivor
    _killed_group_healed_alone(tmp_path, weights, "r0")  # group 1's node 0 restarted with its group
    assert _weights(tmp_path / "g0r0.weights") == weights
    for group in (0, 1):  # one rank per node: node ranks 0 and 1 in each group of WORLD_SIZE 2
        seen = {ast.literal_eval((tmp_path / f"g{group}r{rank}.env").read_text()) for rank in (0, 1)}
        assert seen == {(0, 0, 2), (1, 1, 2)}, (group, seen)
    last = distributor.last_run
    assert last is not None and [(a.replica_group, a.end) for a in last.attempts] == [
        (0, AttemptEnd.SUCCEEDED),
        (1, AttemptEnd.FAILED),
        (1, AttemptEnd.SUCCEEDED),
    ]
    assert [a.nodes for a in last.attempts] == [2, 2, 2]


def test_ctrl_c_stops_every_group(tmp_path: Path, no_leftovers: None) -> None:
    """SIGINT reaches the driver's main thread only; every group's run stops its ranks as a
    Ctrl-C stops a run's, run() raises KeyboardInterrupt and last_run is the stopped run
    (tests/scripts/ft_interrupt.py)."""
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [sys.executable, str(root / "tests" / "scripts" / "ft_interrupt.py"), str(tmp_path)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert "interrupted" in lines and "ranks still running: []" in lines, done.stdout
    shown = "last_run: stopped by Ctrl-C, KeyboardInterrupt, groups ['stopped by Ctrl-C', 'stopped by Ctrl-C']"
    assert shown in lines, done.stdout


def test_what_a_plain_functions_ranks_see_and_the_warning_it_gets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, no_leftovers: None
) -> None:
    """A function that never creates a torchft Manager, two groups of one rank: each rank gets its
    share of the cores over both groups' ranks (the env and torch's thread count the rank really
    has), torchft's Rust logs at warn, a title that names its group; the run warns that the groups
    never synced, naming them."""
    from spark_torch.driver.run.cpus import available_cpus

    if available_cpus() < 2:
        pytest.skip("needs 2 CPUs: with 1, a group's share and the whole run's share are both 1 thread")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # one exported on the driver is the user's to keep
    monkeypatch.delenv("RUST_LOG", raising=False)
    caplog.set_level("WARNING", logger="spark_torch")
    distributor = Distributor(num_processes=2, replica_groups=2, timeout=120, log_ranks=[])
    assert distributor.run(ft_programs.what_a_rank_sees, str(tmp_path)) == 0
    share = max(1, available_cpus() // 2)
    for group in (0, 1):
        seen = json.loads((tmp_path / f"seen-{group}.json").read_text())
        assert (seen["OMP_NUM_THREADS"], seen["MKL_NUM_THREADS"], seen["torch_threads"]) == (
            str(share),
            str(share),
            share,
        ), seen
        assert seen["RUST_LOG"] == "warn"
        assert seen["cmdline"] == ["spark-torch", "group", str(group), "rank", "0:", "what_a_rank_sees()"]
    warned = [r.getMessage() for r in caplog.records if "never created a torchft Manager" in r.getMessage()]
    assert len(warned) == 1 and "replica groups 0, 1 never created a torchft Manager" in warned[0], warned
    assert "spark_torch.ft.manager(" in warned[0] and "did not sync" in warned[0]


def test_a_function_with_a_manager_is_not_warned(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, no_leftovers: None
) -> None:
    """Both groups made the Manager (spark_torch.ft.manager): no warning about copies that never synced."""
    caplog.set_level("WARNING", logger="spark_torch")
    distributor = Distributor(
        num_processes=2, replica_groups=2, lighthouse_options=_options(), timeout=120, log_ranks=[]
    )
    distributor.run(ft_programs.train, 2, str(tmp_path))
    assert not [r for r in caplog.records if "never created a torchft Manager" in r.getMessage()]


def test_executors_without_torchft_fail_the_run_before_any_restart(
    spark_session: Any, monkeypatch: pytest.MonkeyPatch, no_leftovers: None
) -> None:
    """The check of the executors' Python looks for torchft before a group's barrier job (here a
    module no Python has stands in for it): one LaunchError saying how to install it, no group
    restarted although max_restarts allows it."""
    from spark_torch.driver.run import controller
    from spark_torch.errors import LaunchError

    monkeypatch.setattr(controller, "FT_MODULE", "spark_torch_test_no_torchft")
    distributor = Distributor(
        num_processes=2,
        local_mode=False,
        replica_groups=2,
        spark=spark_session,
        max_restarts=2,
        timeout=120,
        log_ranks=[],
    )
    with pytest.raises(LaunchError) as raised:
        distributor.run(ft_programs.needs, "spark_torch_test_no_torchft")  # each rank would fail importing it
    message = str(raised.value)
    assert "cannot import spark_torch_test_no_torchft" in message and "\n" not in message, message
    assert "pip install 'torchft>=0.2.0' into the Python of the driver and of the executors" in message, message
    last = distributor.last_run
    assert last is not None and last.restarts == 0 and [r.restarts for r in last.replica_groups] == [0, 0]
    assert AttemptEnd.LAUNCH_FAILED in {a.end for a in last.attempts} and AttemptEnd.FAILED not in {
        a.end for a in last.attempts
    }
