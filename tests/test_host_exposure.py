"""What a run exposes to others on its host. Every listener a run opens binds the node's own
address (loopback in local mode and in a loopback session), never every interface: the
rendezvous store (torch's ``TCPStore``, no authentication), hosted warm or cold, gloo's pairs,
the driver's channel. Checked during a run from inside a rank, in both modes, against the
listening sockets of this test's whole process tree (``psutil.net_connections``, what ``ss
-ltnp`` shows). And the run's storage is private (0700 folders, 0600 files) whatever the
umask, or shared with a team folder's group (a set-group-ID storage folder: 2770, 0660)."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path
from typing import Any

import psutil
import pytest

from spark_torch import Distributor
from spark_torch.node.template.client import TEMPLATE_MODULE


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
    seen = {"told_to_host": told_to_host, "listeners": _tree_listeners(root), "master_port": int(os.environ["MASTER_PORT"]), "pid": os.getpid()}
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
