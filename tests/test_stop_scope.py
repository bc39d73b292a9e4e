"""A stop reaches only its own attempt's processes: the node marker carries a random token per
node and attempt, so a process of the same user with the same run id and node rank but another
token survives a run's stop, and two runs given the same ``run_id`` at once do not stop each
other's ranks. The driver's wait for stopping nodes is derived from the nodes' grace."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from spark_torch import DistributedRunError, Distributor
from spark_torch.base import envnames, grace
from spark_torch.driver.run import barrier
from spark_torch.node import rank_group, reaper_main, store_host
from spark_torch.node.process_tree import terminate_trees
from spark_torch.node.workdir import NodeWorkdir, node_marker


def _bystander(run_id: str, token: str) -> subprocess.Popen[bytes]:
    """A process of this user carrying a node's run id and node rank 0, with ``token``."""
    env = {**os.environ, envnames.RUN_ID: run_id, envnames.NODE_RANK: "0", envnames.NODE_TOKEN: token}
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], env=env, start_new_session=True)


def fail_now() -> None:
    """A rank that fails at once."""
    raise ValueError("a quick failure")


def test_a_process_with_the_same_run_id_and_node_rank_but_another_token_survives(no_leftovers: None) -> None:
    bystander = _bystander("same-id", "another-token")
    try:
        with pytest.raises(DistributedRunError, match="a quick failure"):
            Distributor(num_processes=1, run_id="same-id").run(fail_now)
        assert bystander.poll() is None, "a run's stop killed another process with its run id and node rank"
        # the marker's token is what decides: with the same token, it is the node's
        marker = node_marker("same-id", 0, "another-token")
        assert terminate_trees([], grace=5.0, marker=marker) == []
        assert bystander.wait(10) is not None
    finally:
        bystander.kill()
        bystander.wait()


def test_every_node_attempt_draws_its_own_token() -> None:
    with NodeWorkdir("same-id", 0) as first, NodeWorkdir("same-id", 0) as second:
        assert set(first.marker) == set(envnames.NODE_MARKER)
        assert first.marker[envnames.RUN_ID] == second.marker[envnames.RUN_ID] == "same-id"
        assert len(first.marker[envnames.NODE_TOKEN]) == 32
        assert first.marker[envnames.NODE_TOKEN] != second.marker[envnames.NODE_TOKEN]


def wait_for_file(path: str) -> str:
    """A long rank: runs until the test creates ``path`` (bounded)."""
    deadline = time.monotonic() + 120
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the test never created {path}")
        time.sleep(0.05)
    return "long run ok"


def test_two_runs_with_the_same_run_id_do_not_stop_each_other(tmp_path: Path, no_leftovers: None) -> None:
    """A long run, and meanwhile three quick failing runs given the same run_id (each with its
    own storage): every failing run stops its own ranks, and the long run finishes."""
    go, started = str(tmp_path / "go"), tmp_path / "started"
    results: dict[str, Any] = {}

    def long_run() -> None:
        try:
            storage = tempfile.mkdtemp(dir=tmp_path)
            results["long"] = Distributor(num_processes=1, run_id="same-id", storage_path=storage).run(
                _touch_then_wait, str(started), go
            )
        except BaseException as exc:  # noqa: BLE001 - asserted below
            results["long"] = exc

    thread = threading.Thread(target=long_run)
    thread.start()
    try:
        deadline = time.monotonic() + 120
        while not started.exists() and thread.is_alive():
            assert time.monotonic() < deadline, "the long run's rank did not start within 120 s"
            time.sleep(0.05)
        for _ in range(3):
            storage = tempfile.mkdtemp(dir=tmp_path)
            with pytest.raises(DistributedRunError, match="a quick failure"):
                Distributor(num_processes=1, run_id="same-id", storage_path=storage).run(fail_now)
    finally:
        Path(go).touch()
        thread.join(120)
    assert results["long"] == "long run ok"


def _touch_then_wait(started: str, go: str) -> str:
    Path(started).touch()
    return wait_for_file(go)


def test_the_drivers_wait_is_derived_from_the_nodes_grace() -> None:
    """One constant: the node's grace (its runner's and its reaper's) and what the driver waits
    for stopping nodes before it cancels the job or restarts."""
    names = {
        name
        for module in (rank_group, reaper_main, barrier, store_host)
        for name in vars(module)
        if name.endswith("GRACE_SECONDS")
    }
    assert names <= set(grace.__all__), names  # a grace is named in grace.py only (imported, never renamed)
    assert all(
        getattr(module, name) == getattr(grace, name)
        for module in (rank_group, reaper_main, store_host)
        for name in names
        if hasattr(module, name)
    )
    assert grace.DRIVER_STOP_WAIT_SECONDS > grace.RANK_GRACE_SECONDS
