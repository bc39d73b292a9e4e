"""End to end on a real Spark standalone cluster: a master and two worker JVMs on loopback.

One cluster and one SparkSession serve every test here (``standalone_spark`` sorts after the
local and local-cluster sessions, see conftest's ``_ORDER``). Each worker offers 2 cores and
the session takes one 1-core executor on each (``spark.cores.max=2``), so a second application
(the spark-submit test) still finds one free core per worker.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from spark_torch import AttemptEnd, AttemptReason, Distributor

from .conftest import SCRIPTS, make_session, wait_for_slots
from .sessions import stop_active
from .standalone import (
    StandaloneCluster,
    check_submit_output,
    leftover_processes,
    standalone_cluster,
    start_worker,
    stop_daemons,
    submit,
)

pytestmark = pytest.mark.slow

#: executor settings shared by the pytest session and the spark-submit application
EXECUTOR_CONF = {
    "spark.executor.memory": "512m",
    "spark.executor.cores": "1",
    "spark.cores.max": "2",
    "spark.task.cpus": "1",
}


@pytest.fixture(scope="session")
def standalone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StandaloneCluster]:
    """A standalone master + 2 workers (2 cores, 1g each) on 127.0.0.1, ports ephemeral."""
    stop_active()
    with standalone_cluster(tmp_path_factory.mktemp("standalone"), workers=2, cores=2, memory="1g") as cluster:
        yield cluster
    left = leftover_processes(cluster.daemons(), cluster.work_dirs)
    assert not left, f"standalone cluster processes left after teardown: {left}"


@pytest.fixture(scope="session")
def standalone_spark(standalone: StandaloneCluster) -> Iterator[Any]:
    """A SparkSession on the standalone cluster with one 1-core executor per worker."""
    spark = make_session(standalone.url, **{k.replace(".", "_"): v for k, v in EXECUTOR_CONF.items()})
    try:
        wait_for_slots(spark, 2)
        yield spark
    finally:
        spark.stop()


def placement(tag: str) -> dict[str, Any]:
    """On every rank: gloo all_reduce, torchrun env, and the executor JVM this rank runs under."""
    import os

    import psutil
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://")
    keys = (
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "NODE_RANK",
        "GROUP_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "OMP_NUM_THREADS",
    )
    mine: dict[str, Any] = {k: os.environ[k] for k in keys}
    for parent in psutil.Process().parents():
        cmd = parent.cmdline()
        if "org.apache.spark.executor.CoarseGrainedExecutorBackend" in cmd:
            mine["executor_id"] = cmd[cmd.index("--executor-id") + 1]
            mine["worker_url"] = cmd[cmd.index("--worker-url") + 1]
            mine["executor_cwd"] = parent.cwd()
            break
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.destroy_process_group()
    return {"tag": tag, "sum": t.item(), "ranks": gathered}


def check_two_nodes(out: dict[str, Any]) -> list[dict[str, Any]]:
    assert out["tag"] == "x" and out["sum"] == 2.0
    ranks = out["ranks"]
    assert [r["RANK"] for r in ranks] == ["0", "1"]
    assert [r["NODE_RANK"] for r in ranks] == ["0", "1"] == [r["GROUP_RANK"] for r in ranks]
    assert all(r["LOCAL_RANK"] == "0" and r["LOCAL_WORLD_SIZE"] == "1" and r["WORLD_SIZE"] == "2" for r in ranks)
    assert {r["MASTER_ADDR"] for r in ranks} == {"127.0.0.1"}
    assert len({r["MASTER_PORT"] for r in ranks}) == 1
    assert all(r["OMP_NUM_THREADS"] == "1" for r in ranks)
    return ranks


def test_script_standalone(standalone_spark: Any, tmp_path: Path, no_leftovers: None) -> None:
    """2 nodes x 1 rank, a script with arguments and extra env."""
    result = Distributor(num_processes=2, local_mode=False, spark=standalone_spark, env={"EXTRA_VAR": "y"}).run(
        str(SCRIPTS / "env_dump.py"), tmp_path, "--batch_size=16"
    )
    assert result is None
    infos = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)]
    assert [i["RANK"] for i in infos] == ["0", "1"]
    assert [i["NODE_RANK"] for i in infos] == ["0", "1"]
    assert {i["MASTER_ADDR"] for i in infos} == {"127.0.0.1"}
    assert all(i["sum"] == 2.0 and i["WORLD_SIZE"] == "2" and i["LOCAL_WORLD_SIZE"] == "1" for i in infos)
    assert all(i["EXTRA_VAR"] == "y" and i["argv"] == ["--batch_size=16"] for i in infos)


def test_one_node_two_ranks_standalone(standalone_spark: Any, no_leftovers: None) -> None:
    """1 node x 2 ranks: one barrier task hosts both ranks (ranks_per_task=2) on one executor."""
    out = Distributor(num_processes=2, local_mode=False, spark=standalone_spark, ranks_per_task=2).run(placement, "x")
    ranks = out["ranks"]
    assert out["sum"] == 2.0
    assert [r["RANK"] for r in ranks] == ["0", "1"] and [r["LOCAL_RANK"] for r in ranks] == ["0", "1"]
    assert {r["NODE_RANK"] for r in ranks} == {"0"} and {r["LOCAL_WORLD_SIZE"] for r in ranks} == {"2"}
    assert len({r.get("executor_id") for r in ranks}) == 1


def test_ranks_spread_over_workers(standalone_spark: Any, standalone: StandaloneCluster, no_leftovers: None) -> None:
    """2 nodes x 1 rank, a function given a keyword argument: rank 0's result comes back; with
    spark.task.cpus=1 and 2 processes, one barrier task (node) on each worker's executor."""
    assert standalone_spark.conf.get("spark.task.cpus") == "1"
    out = Distributor(num_processes=2, local_mode=False, spark=standalone_spark).run(placement, tag="x")
    ranks = check_two_nodes(out)
    assert all("worker_url" in r for r in ranks), f"executor JVM not found above the ranks: {ranks}"
    assert len({r["executor_id"] for r in ranks}) == 2
    assert len({r["worker_url"] for r in ranks}) == 2, ranks
    work_dirs = {str(p) for p in standalone.work_dirs}
    used = {str(Path(r["executor_cwd"]).parents[1]) for r in ranks}
    assert used == work_dirs, (used, work_dirs)


def test_spark_submit_standalone(
    standalone_spark: Any, standalone: StandaloneCluster, tmp_path: Path, no_leftovers: None
) -> None:
    """spark-submit of tests/scripts/submit_driver.py to the standalone master (a 2nd application)."""
    conf = [arg for k, v in EXECUTOR_CONF.items() for arg in ("--conf", f"{k}={v}")]
    proc = submit(
        [
            "--master",
            standalone.url,
            "--conf",
            "spark.driver.host=127.0.0.1",
            "--conf",
            "spark.ui.enabled=false",
            *conf,
            str(SCRIPTS / "submit_driver.py"),
        ],
        cwd=tmp_path,
    )
    check_submit_output(proc.returncode, proc.stdout)


def _wait_for_file(directory: Path, pattern: str, seconds: float, thread: Any) -> Path:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        found = sorted(directory.glob(pattern))
        if found:
            return found[0]
        if not thread.is_alive():
            raise AssertionError(
                f"the run ended before {pattern} appeared: {sorted(p.name for p in directory.iterdir())}"
            )
        time.sleep(0.2)
    raise AssertionError(
        f"no {pattern} in {directory} within {seconds:g}s: {sorted(p.name for p in directory.iterdir())}"
    )


def test_a_worker_leaves_and_comes_back(
    standalone_spark: Any,
    standalone: StandaloneCluster,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    no_leftovers: None,
) -> None:
    """Elastic membership on a real cluster: N=2, M=1. A worker is stopped after epoch 3: the run
    goes on with 1 rank from the latest checkpoint. The worker starts again: once its slot has
    been free for elastic_wait, the run grows back to 2 ranks at the next checkpoint (elastic_grow).
    Every epoch exactly once (the all-reduce count), whatever the size. Last in this file: it
    replaces a worker of the shared cluster and the shared session. Each step is forced, not
    hoped for: the first attempt waits before epoch 4 until the worker is gone, the shrunk one
    before epoch 10 until the grow watch is ready (and never goes past it: it is stopped to grow)."""
    import threading

    from spark_torch.driver.run import barrier

    from .elastic_programs import count_epochs

    markers = tmp_path / "markers"
    markers.mkdir()
    gone = tmp_path / "worker-gone"  # the first attempt holds before epoch 4 until the worker is stopped
    back = tmp_path / "worker-back"  # the shrunk run holds at epoch 10 until the grow watch is ready
    watches: list[Any] = []
    grow_watch = barrier.GrowWatch

    def recorded_grow_watch(*args: Any, **kwargs: Any) -> Any:
        watches.append(grow_watch(*args, **kwargs))
        return watches[-1]

    monkeypatch.setattr(barrier, "GrowWatch", recorded_grow_watch)
    # one 2-core executor per worker, a task takes both cores: a lost worker's slot cannot move to the other
    spark = make_session(
        standalone.url, spark_executor_cores="2", spark_task_cpus="2", spark_cores_max="4", spark_executor_memory="512m"
    )
    wait_for_slots(spark, 2)
    d = Distributor(
        num_processes=2,
        min_processes=1,
        local_mode=False,
        spark=spark,
        storage_path=tmp_path / "runs",
        max_restarts=2,
        elastic_wait=3,
        elastic_grow=True,
        log_ranks=[],
    )
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["out"] = d.run(count_epochs, 20, str(markers), 0.05, None, str(back), 10, str(gone))
            box["result"] = d.last_run  # last_run is per thread
        except BaseException as exc:  # noqa: BLE001 - asserted below
            box["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    try:
        _wait_for_file(markers, "attempt-0-world-2-epoch-3", 180, thread)
        leaving = standalone.workers[1]
        stop_daemons([leaving])  # the worker and its executor JVM go away
        gone.touch()
        _wait_for_file(markers, "attempt-1-world-1-epoch-*", 180, thread)  # shrunk to 1 rank
        logs = leaving.log.parent
        standalone.workers[1] = start_worker("worker-1-again", standalone.url, standalone.work_dirs[1], logs, cores=2)
        wait_for_slots(spark, 2, 180)
        assert len(watches) == 1 and watches[0].ready.wait(180), (
            "the shrunk attempt's grow watch never saw the slot free"
        )
        back.touch()
    finally:
        thread.join(400)
        spark.stop()
    assert not thread.is_alive(), "the elastic run did not end"
    assert "error" not in box, box.get("error")
    assert box["out"]["count"] == 20.0 and box["out"]["world_size"] == 2
    result = box["result"]
    assert result is not None and [a.world_size for a in result.attempts] == [2, 1, 2], result.attempts
    assert [a.reason for a in result.attempts] == [
        AttemptReason.START,
        AttemptReason.RESTART_AFTER_FAILURE,
        AttemptReason.GROW,
    ]
    assert [a.end for a in result.attempts] == [AttemptEnd.FAILED, AttemptEnd.GROW_REQUESTED, AttemptEnd.SUCCEEDED]
    assert result.attempts[1].grow is not None and (result.attempts[1].grow.running, result.attempts[1].grow.nodes) == (
        1,
        2,
    )
    assert result.attempts[1].detail.startswith("slots for 2 nodes were free for 3s"), result.attempts
    history = result.metrics_dataframe
    assert history["epoch"].tolist() == list(range(1, 21))
    assert sorted(set(history["world_size"])) == [1, 2]
