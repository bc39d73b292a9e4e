"""What a run exposes to others on its host. Every listener a run opens binds the node's own
address (loopback in local mode and in a loopback session), never every interface: the
rendezvous store (torch's ``TCPStore``, no authentication), hosted warm or cold, gloo's pairs,
the driver's channel. Checked during a run from inside a rank, in both modes, against the
listening sockets of this test's whole process tree (``psutil.net_connections``, what ``ss
-ltnp`` shows). And the run's storage is private (0700 folders, 0600 files) whatever the
umask, or shared with a team folder's group (a set-group-ID storage folder: 2770, 0660); a
run folder another user made first, or swapped in under a running run, is refused in both modes,
on the driver and in a rank's report(), and nothing is written through its links."""

from __future__ import annotations

import os
import stat
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from spark_torch import ConfigurationError, DistributedRunError, Distributor
from spark_torch.node.template.client import TEMPLATE_MODULE
from tests.other_user import NOBODY, as_user


def _tree(root: int) -> set[int]:
    """``root``, its descendants, and the warm-start templates one of them owns with their
    descendants: a template outlives the Spark worker that started it (its parent is then init),
    so a run forked from an older template is outside ``root``'s tree of parents."""
    pids = {root} | {p.pid for p in psutil.Process(root).children(recursive=True)}
    for process in psutil.process_iter(["cmdline"]):
        cmd = process.info["cmdline"] or []
        if TEMPLATE_MODULE in cmd and len(cmd) > cmd.index(TEMPLATE_MODULE) + 2:
            owner = cmd[cmd.index(TEMPLATE_MODULE) + 2]
            if owner.isdigit() and int(owner) in pids:
                try:
                    pids |= {process.pid} | {p.pid for p in process.children(recursive=True)}
                except psutil.Error:
                    pass
    return pids


def _tree_listeners(root: int) -> list[tuple[str, int, int, str]]:
    """(address, port, pid, command line) of every TCP socket listening in ``root``'s tree."""
    pids = _tree(root)
    found = []
    for conn in psutil.net_connections("inet"):
        if conn.status == psutil.CONN_LISTEN and conn.pid in pids:
            try:
                cmd = " ".join(psutil.Process(conn.pid).cmdline())
            except psutil.Error:
                cmd = ""
            found.append((conn.laddr.ip, conn.laddr.port, conn.pid, cmd))
    return found


def listeners_during_a_run(root: int) -> dict[str, Any]:
    """In a rank, once the process group is up: what listens in the test's process tree."""
    import torch.distributed as dist

    told_to_host = os.environ.get("SPARK_TORCH_HOST_STORE")
    dist.init_process_group("gloo", init_method="env://")
    seen = {
        "told_to_host": told_to_host,
        "listeners": _tree_listeners(root),
        "master_port": int(os.environ["MASTER_PORT"]),
        "pid": os.getpid(),
    }
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, seen)
    dist.destroy_process_group()
    return {"ranks": gathered}


def _spark_jvm(cmd: str) -> bool:
    """Spark's own JVM (its RPC, block manager, barrier coordinator): Spark's listeners, not the run's."""
    return "org.apache.spark" in cmd and os.path.basename(cmd.split(" ", 1)[0]) == "java"


def _check(out: dict[str, Any], before: set[tuple[str, int]], hosted: bool = True) -> list[tuple[str, int, int, str]]:
    """Every listener the run opened is on loopback, the store too: hosted apart from the ranks
    (``hosted``), or, warm starts off, by rank 0 (torch's own server would listen on every interface)."""
    opened = [e for e in out["ranks"][0]["listeners"] if e[:2] not in before and not _spark_jvm(e[3])]
    (store,) = [entry for entry in opened if entry[1] == out["ranks"][0]["master_port"]]
    everywhere = [entry for entry in opened if entry[0] != "127.0.0.1"]
    assert everywhere == [], f"listeners not on the node's own address: {everywhere}"
    if hosted:
        assert "spark_torch.node.store_host_main" in store[3] or "spark_torch.node.template.server" in store[3], store
        assert store[2] not in {r["pid"] for r in out["ranks"]}  # no rank hosts it
    else:  # rank 0, before the user's code (spark_torch.rank.store)
        assert store[2] == out["ranks"][0]["pid"], store
    assert [r["told_to_host"] for r in out["ranks"]] == [None] * len(out["ranks"])  # removed before the user's code
    return opened


@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
def test_local_mode_listens_on_loopback_only(warm: bool, no_leftovers: None) -> None:
    """Warm: the store host listens on loopback. Warm starts off: rank 0 hosts the store itself,
    on loopback too (torch's own server would listen on every interface); everything else is on
    loopback, and the user's code never sees the variable that told rank 0 to host it."""
    before = {entry[:2] for entry in _tree_listeners(os.getpid())}
    out = Distributor(num_processes=2, warm_start=warm).run(listeners_during_a_run, os.getpid())
    _check(out, before, hosted=warm)


def test_a_loopback_session_listens_on_loopback_only(spark_session: Any, no_leftovers: None) -> None:
    """Distributed: the store on node 0's executor address (127.0.0.1 here) and the driver's
    channel on ``spark.driver.bindAddress``."""
    before = {entry[:2] for entry in _tree_listeners(os.getpid())}
    out = Distributor(num_processes=2, local_mode=False).run(listeners_during_a_run, os.getpid())
    opened = _check(out, before)
    assert any(entry[2] == os.getpid() for entry in opened), f"the driver's channel is not among {opened}"


def checkpoint_and_metrics() -> None:
    """Rank: one report() with metrics and a checkpoint file written 0644 (the umask's)."""
    import spark_torch

    folder = tempfile.mkdtemp()
    with open(os.path.join(folder, "weights.bin"), "wb") as fh:
        fh.write(b"w")
    os.chmod(folder, 0o755)
    os.chmod(os.path.join(folder, "weights.bin"), 0o644)
    spark_torch.report({"loss": 1.0}, checkpoint=folder)


def _modes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): stat.S_IMODE(p.stat().st_mode) for p in [root, *root.rglob("*")]}


@pytest.mark.parametrize("team", [False, True], ids=["private", "team-folder"])
def test_the_runs_storage_is_private_or_the_team_folders(team: bool, tmp_path: Path, no_leftovers: None) -> None:
    base = tmp_path / "runs"
    base.mkdir()
    if team:
        base.chmod(0o2770)  # a team's folder: its group shares the runs
    mask = os.umask(0o022)
    try:
        Distributor(num_processes=1, storage_path=str(base)).run(checkpoint_and_metrics)
    finally:
        os.umask(mask)
    (run_dir,) = list(base.iterdir())
    modes = _modes(run_dir)
    folders = {name for name in modes if (run_dir / name).is_dir()}
    assert any(name.endswith("weights.bin") for name in modes) and any(name.endswith("metrics.jsonl") for name in modes)
    folder_mode, file_mode = (0o2770, 0o660) if team else (0o700, 0o600)
    wrong = {name: oct(mode) for name, mode in modes.items() if mode != (folder_mode if name in folders else file_mode)}
    assert wrong == {}, f"expected folders {oct(folder_mode)} and files {oct(file_mode)}: {wrong}"


RUN = "planted-run"
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="playing another user needs root (setuid in a child)")


def _mode(request: pytest.FixtureRequest, local_mode: bool) -> Any:
    """Distributed: the ``local[2]`` session, whose barrier task runs the ranks; local: none."""
    return None if local_mode else request.getfixturevalue("spark_session")


@needs_root
@pytest.mark.parametrize("local_mode", [True, False], ids=["local", "distributed"])
def test_a_run_folder_another_user_made_first_is_refused(
    local_mode: bool, request: pytest.FixtureRequest, open_base: Path, victim: Path, no_leftovers: None
) -> None:
    """Issue 55's attack: nobody makes RUN_ID/ first, its metrics.jsonl a link to the victim's
    file and a 0666 attempts.jsonl of its own. The run stops at once with a ConfigurationError
    naming the folder and what to do; nothing reaches either file, and nothing is left."""
    spark = _mode(request, local_mode)

    def plant() -> None:
        run = open_base / RUN
        run.mkdir(0o777)
        (run / "metrics.jsonl").symlink_to(victim)
        (run / "attempts.jsonl").touch(0o666)

    as_user(NOBODY, NOBODY, plant)
    started = time.monotonic()
    with pytest.raises(ConfigurationError) as caught:
        Distributor(num_processes=1, local_mode=local_mode, storage_path=str(open_base), run_id=RUN, spark=spark).run(
            checkpoint_and_metrics
        )
    elapsed = time.monotonic() - started
    message = str(caught.value)
    assert f"{open_base / RUN} belongs to another user (uid {NOBODY})" in message and "storage_path=" in message
    assert elapsed < 5.0, f"refused after {elapsed:.1f}s"
    assert victim.read_text() == "mine\n" and (open_base / RUN / "attempts.jsonl").stat().st_size == 0
    assert sorted(os.listdir(open_base)) == [RUN] and sorted(os.listdir(open_base / RUN)) == [
        "attempts.jsonl",
        "metrics.jsonl",
    ]


@needs_root
def test_the_default_storage_refuses_too(
    open_base: Path, victim: Path, monkeypatch: pytest.MonkeyPatch, no_leftovers: None
) -> None:
    """~/spark_torch_runs made under umask 000 (0777) with nobody's RUN_ID/ in it: the run is
    refused the same way (not run without checkpoints, as a default that cannot be created is)."""
    home = open_base / "home"
    (home / "spark_torch_runs").mkdir(parents=True)
    (home / "spark_torch_runs").chmod(0o777)
    monkeypatch.setenv("HOME", str(home))
    as_user(NOBODY, NOBODY, lambda: (home / "spark_torch_runs" / RUN).mkdir(0o777))
    with pytest.raises(ConfigurationError, match=f"{home / 'spark_torch_runs' / RUN} belongs to another user"):
        Distributor(num_processes=1, run_id=RUN).run(checkpoint_and_metrics)
    assert os.listdir(home / "spark_torch_runs" / RUN) == [] and victim.read_text() == "mine\n"


def swap_then_report(base: str, victim_dir: str) -> None:
    """Rank: one checkpoint reported; then, as another user would in a storage folder all may
    write to, the run's folder is moved away and nobody's own put in its place, holding a link
    to the victim's folder where the next checkpoint goes; then report() again."""
    import spark_torch
    from tests.other_user import NOBODY, as_user

    folder = tempfile.mkdtemp()
    with open(os.path.join(folder, "weights.bin"), "wb") as fh:
        fh.write(b"w")
    spark_torch.report({"loss": 1.0}, checkpoint=folder)
    run = os.path.join(base, RUN)
    os.rename(run, run + ".moved")

    def plant() -> None:
        os.mkdir(run, 0o777)
        os.symlink(victim_dir, os.path.join(run, "checkpoint_000002"))

    as_user(NOBODY, NOBODY, plant)
    spark_torch.report({"loss": 0.5}, checkpoint=folder)


@needs_root
@pytest.mark.parametrize(
    "session",
    [None, "spark_session", pytest.param("cluster_spark", marks=pytest.mark.slow)],
    ids=["local", "distributed", "local-cluster"],
)
def test_a_run_folder_swapped_under_a_running_run_is_refused_in_the_rank(
    session: str | None, request: pytest.FixtureRequest, open_base: Path, tmp_path: Path, no_leftovers: None
) -> None:
    """The rank's report() (on the executor, distributed: a Python worker of the driver's JVM,
    or of an executor JVM of its own) opens the run's folder afresh for each checkpoint: the
    swapped-in folder is refused, naming it, and nothing lands in the victim's folder; the
    driver's own later writes (the run's log) are refused too, with a warning."""
    local_mode = session is None
    spark = request.getfixturevalue(session) if session is not None else None
    victim_dir = tmp_path / "victim_dir"
    victim_dir.mkdir()
    with pytest.raises(DistributedRunError) as caught:
        Distributor(num_processes=1, local_mode=local_mode, storage_path=str(open_base), run_id=RUN, spark=spark).run(
            swap_then_report, str(open_base), str(victim_dir)
        )
    message = str(caught.value)
    assert (
        f"ConfigurationError: the run's storage {open_base / RUN} belongs to another user (uid {NOBODY})" in message
    ), message
    assert list(victim_dir.iterdir()) == []
    assert sorted(os.listdir(open_base / RUN)) == ["checkpoint_000002"]
    assert (open_base / (RUN + ".moved") / "checkpoint_000001" / "weights.bin").read_bytes() == b"w"
