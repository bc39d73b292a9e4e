"""Process control: whole process trees stopped (also descendants in a session of their own),
never a recycled pid, a short grace on Ctrl-C, a run finishing at its deadline is no timeout."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import psutil
import pytest

from spark_torch import DistributedRunError, Distributor
from spark_torch.base.states import RankState
from spark_torch.node.process_tree import create_time, terminate_trees
from spark_torch.node.rank_group import GroupState, NodeSpec, run_ranks
from spark_torch.node.reaper_main import parse_line
from spark_torch.node.workdir import NodeWorkdir
from spark_torch.shared.spec import LaunchPlan, RunSpec

from .conftest import SCRIPTS
from .test_cli import _interrupt_after_first_line


def spawn_escaped_child_and_fail(pid_file: str) -> None:
    """A rank whose child starts a session of its own (out of the rank's process group) and
    ignores SIGTERM, then the rank fails."""
    child = subprocess.Popen(
        [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"],
        start_new_session=True,
    )
    with open(pid_file, "w") as fh:
        fh.write(f"{child.pid} {psutil.Process(child.pid).create_time()!r}")
    raise RuntimeError("the rank failed after starting a daemon")


def test_descendant_in_its_own_session_is_stopped(tmp_path: Path, no_leftovers: None) -> None:
    pid_file = tmp_path / "child.pid"
    with pytest.raises(DistributedRunError, match="the rank failed after starting a daemon"):
        Distributor(num_processes=1).run(spawn_escaped_child_and_fail, str(pid_file))
    pid, created = pid_file.read_text().split()
    try:
        child = psutil.Process(int(pid))
        alive = child.create_time() == float(created) and child.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        alive = False
    assert not alive, "the rank's escaped child survived the run"


def detach_a_grandchild(name: str, fail: bool) -> dict[str, Any]:
    """A rank that forks (no exec: it keeps the rank's /proc environment block) a grandchild
    which starts a session of its own, names itself ``name`` and sleeps; the rank returns (or
    fails) once the grandchild is set up."""
    import ctypes

    libc = ctypes.CDLL(None)  # loaded before the fork: the child calls only into it
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(ready_r)
            os.setsid()
            libc.prctl(15, name.encode())  # PR_SET_NAME: what psutil's name() shows
            os.write(ready_w, b"x")
            time.sleep(600)
        finally:
            os._exit(0)
    os.close(ready_w)
    assert os.read(ready_r, 1) == b"x"
    parent = " ".join(psutil.Process(os.getppid()).cmdline())
    if fail:
        raise RuntimeError(f"the rank failed after detaching {pid} (its parent: {parent})")
    return {"pid": pid, "parent": parent}


def _named(name: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["name"]):
        try:
            if proc.info["name"] == name and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except psutil.Error:
            continue
    return found


def _run_detaching(distributor: Distributor, fail: bool) -> tuple[str, list[psutil.Process]]:
    """Run :func:`detach_a_grandchild`; the rank's parent's command line and the grandchildren
    that survived the run (killed here, so that a failing test leaves nothing behind)."""
    name = f"st-{uuid.uuid4().hex[:10]}"
    try:
        if fail:
            with pytest.raises(DistributedRunError, match="the rank failed after detaching") as info:
                distributor.run(detach_a_grandchild, name, True)
            parent = str(info.value)
        else:
            parent = distributor.run(detach_a_grandchild, name, False)["parent"]
        return parent, _named(name)
    finally:
        for proc in _named(name):
            with contextlib.suppress(psutil.Error):
                proc.kill()


@pytest.mark.parametrize("fail", [False, True], ids=["success", "failure"])
@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
def test_a_forked_descendant_in_its_own_session_is_stopped(warm: bool, fail: bool, no_leftovers: None) -> None:
    """A rank's forked (not exec'd) descendant that left the rank's session is stopped when the
    run ends, whether the run succeeded or failed, for warm ranks (forks of the template, whose
    environment block they show) as for cold ones."""
    parent, survivors = _run_detaching(Distributor(num_processes=1, warm_start=warm), fail)
    assert ("spark_torch.node.template.server" in parent) is warm
    assert survivors == [], "the rank's detached grandchild survived the run"


def test_a_forked_descendant_of_a_warm_rank_is_stopped_on_an_executor(spark_session: Any, no_leftovers: None) -> None:
    parent, survivors = _run_detaching(Distributor(num_processes=1, local_mode=False, warm_start=True), fail=True)
    assert "spark_torch.node.template.server" in parent
    assert survivors == [], "the rank's detached grandchild survived the run"


def test_a_recycled_pid_is_never_signalled() -> None:
    """A group reference whose leader's creation time does not match is left alone."""
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    try:
        stale = (bystander.pid, create_time(bystander.pid) - 100.0)
        assert terminate_trees([stale], grace=0.1, marker={"SPARK_TORCH_RUN_ID": "not-this-one"}) == []
        assert bystander.poll() is None, "a process with a recycled pid was killed"
        terminate_trees([(bystander.pid, create_time(bystander.pid))], grace=0.1)
        assert bystander.wait(5) is not None
    finally:
        bystander.kill()
        bystander.wait()


def test_reaper_lines() -> None:
    assert parse_line("1234 1700000000.25") == (1234, 1700000000.25)
    assert parse_line("done") is None and parse_line("12 x") is None and parse_line("-1 2.0") is None


@pytest.mark.parametrize(
    "mode",
    [["--local"], ["--distributed", "--master", "local[2]", "--conf", "spark.driver.host=127.0.0.1"]],
    ids=["local", "distributed"],
)
def test_ctrl_c_gives_ranks_a_grace_period(mode: list[str], tmp_path: Path) -> None:
    """On Ctrl-C the ranks get SIGTERM and a moment to shut down before SIGKILL."""
    code, _took = _interrupt_after_first_line(
        ["run", "-n", "2", *mode, str(SCRIPTS / "graceful.py"), str(tmp_path)], lines=2
    )
    assert code == 130
    deadline = time.monotonic() + 10
    while len(list(tmp_path.glob("rank-*.terminated"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert sorted(p.name for p in tmp_path.glob("rank-*.terminated")) == ["rank-0.terminated", "rank-1.terminated"]


class _DeadlineAtTheLastExit:
    """A line sink whose rank events set ``stop`` (the run's deadline) just as the last rank
    is recorded as finished: the node runner then sees the exit and the deadline together."""

    def __init__(self, stop: threading.Event, ranks: int) -> None:
        self.stop = stop
        self.left = ranks

    def __call__(self, rank: int, stream: str, block: str) -> None:
        pass

    def flush(self) -> None:
        pass

    def rank_event(self, rank: int, state: str) -> None:
        if state == "finished":
            self.left -= 1
            if self.left == 0:
                self.stop.set()


def test_a_run_that_finished_at_its_deadline_is_not_a_timeout() -> None:
    spec = RunSpec(
        plan=LaunchPlan(local_mode=True, num_nodes=1, procs_per_node=2, use_gpu=False),
        run_id="deadline",
        script=str(SCRIPTS / "exit_code.py"),
        script_argv=("0",),
    )
    stop = threading.Event()
    node = NodeSpec(run=spec, node_rank=0, master_addr="127.0.0.1", master_port=1, cwd=os.getcwd())
    with NodeWorkdir(spec.run_id, 0) as workdir:
        outcome = run_ranks(node, _DeadlineAtTheLastExit(stop, 2), workdir, stop=stop)
    assert stop.is_set() and outcome.state is GroupState.SUCCEEDED and not outcome.failures
    assert [s.state for s in outcome.ranks] == [RankState.FINISHED, RankState.FINISHED]


def test_the_reaper_gets_its_paths_over_its_pipe_not_argv() -> None:
    """``ps`` shows argv to every user of the host: the node's scratch dir (and, on the driver,
    the result directory node 0 hands rank 0's result into) is not in the reaper's argv."""
    from spark_torch.node.workdir import NodeWorkdir

    with NodeWorkdir("argv-check", 0) as workdir:
        reaper_pid = workdir.reaper_pid
        assert reaper_pid is not None
        deadline = time.monotonic() + 10.0
        cmdline = ""
        while not cmdline and time.monotonic() < deadline:  # empty while the kernel still sets up its exec
            cmdline = " ".join(psutil.Process(reaper_pid).cmdline())
        assert "spark_torch.node.reaper_main" in cmdline and workdir.path not in cmdline
        assert "argv-check" not in cmdline


class _OneTaskBarrier:
    """The task context of barrier task 1 of 2 (only what the node runner asks before its ranks start)."""

    def partitionId(self) -> int:  # noqa: N802 - Spark's name
        return 1

    def getTaskInfos(self) -> list[Any]:  # noqa: N802 - Spark's name
        class Info:
            address = "127.0.0.1:1"

        return [Info(), Info()]


def test_a_node_whose_staging_fails_closes_its_channel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The node's channel client starts connecting as soon as the task starts; when staging the
    node's rows fails (a full disk, a broken input partition), the task ends with that error and
    the client is closed, instead of retrying in the background for the worker's lifetime."""
    import socket

    import pyspark

    from spark_torch.channel.driver_end import new_secret
    from spark_torch.node.task import run_barrier_task
    from spark_torch.shared.spec import ChannelSpec, DataSpec

    monkeypatch.setattr(pyspark.BarrierTaskContext, "get", staticmethod(lambda: _OneTaskBarrier()))
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))  # nothing listens: the client keeps retrying until closed
    try:
        channel = ChannelSpec(host="127.0.0.1", port=dead.getsockname()[1], secret=new_secret())
        spec = RunSpec(
            plan=LaunchPlan(local_mode=False, num_nodes=2, procs_per_node=1, use_gpu=False),
            run_id="staging",
            channel=channel,
            data=DataSpec(columns=("x",)),
        )

        def broken_partition() -> Any:
            raise OSError(28, "No space left on device")
            yield  # a generator

        with pytest.raises(OSError, match="No space left on device"):
            list(run_barrier_task(spec, broken_partition()))
        deadline = time.monotonic() + 5.0
        while (
            any(t.name.startswith("spark-torch-channel") for t in threading.enumerate()) and time.monotonic() < deadline
        ):
            time.sleep(0.05)
        assert not [t.name for t in threading.enumerate() if t.name.startswith("spark-torch-channel")]
    finally:
        dead.close()
