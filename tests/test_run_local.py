"""End to end in local mode: real rank processes on this machine (Spark session optional)."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from spark_torch import ConfigurationError, DistributedRunError, Distributor

from .conftest import SCRIPTS


def env_and_allreduce(tag: str, scale: int = 1) -> dict[str, object]:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    dist.destroy_process_group()
    print(f"rank {os.environ['RANK']} done", flush=True)
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "MASTER_ADDR")
    return {"tag": tag, "sum": t.item() * scale, **{k: os.environ[k] for k in keys}}


def slow_on_rank0(seconds: float) -> int:
    """Rank 0 finishes last: the result must still be rank 0's."""
    rank = int(os.environ["RANK"])
    if rank == 0:
        time.sleep(seconds)
    return rank


@pytest.mark.smoke
def test_function_returns_rank0_result(no_leftovers: None, capsys: pytest.CaptureFixture[str]) -> None:
    environ_before = dict(os.environ)
    out = Distributor(num_processes=3).run(env_and_allreduce, "t", scale=2)
    assert out["tag"] == "t" and out["sum"] == 12.0
    assert out["RANK"] == "0" and out["WORLD_SIZE"] == "3" and out["LOCAL_WORLD_SIZE"] == "3"
    assert out["NODE_RANK"] == out["GROUP_RANK"] == "0" and out["MASTER_ADDR"] == "127.0.0.1"
    assert dict(os.environ) == environ_before
    captured = capsys.readouterr().out
    for rank in range(3):
        assert f"[rank {rank}] rank {rank} done" in captured


def test_result_is_rank0_not_last_writer(no_leftovers: None) -> None:
    assert Distributor(num_processes=2).run(slow_on_rank0, 1.0) == 0


def test_script_env_and_args(tmp_path: Path, no_leftovers: None) -> None:
    result = Distributor(num_processes=2, env={"EXTRA_VAR": "x"}).run(
        str(SCRIPTS / "env_dump.py"), tmp_path, "--lr=0.001", 3
    )
    assert result is None
    infos = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)]
    assert [i["RANK"] for i in infos] == ["0", "1"] and infos[1]["LOCAL_RANK"] == "1"
    assert all(i["sum"] == 2.0 and i["EXTRA_VAR"] == "x" for i in infos)
    assert infos[0]["argv"] == ["--lr=0.001", "3"]
    assert infos[0]["OMP_NUM_THREADS"] == str(max(1, (os.cpu_count() or 1) // 2))


@pytest.mark.smoke
def test_script_exit_code_is_failure(no_leftovers: None) -> None:
    start = time.monotonic()
    with pytest.raises(DistributedRunError, match=r"^rank 1 on .* failed: exited with code 2") as info:
        Distributor(num_processes=2).run(str(SCRIPTS / "exit_code.py"), 2, 1)
    assert isinstance(info.value, RuntimeError) and info.value.rank == 1
    assert "rank 1 exiting with 2" in str(info.value)  # the rank's last lines
    assert time.monotonic() - start < 30


def test_script_exception_traceback(no_leftovers: None) -> None:
    with pytest.raises(DistributedRunError, match=r"rank 1 on .* failed: exited with code 1") as info:
        Distributor(num_processes=2).run(str(SCRIPTS / "raises.py"))
    assert "ValueError: script failed on purpose" in str(info.value)


def fails_in_collective() -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://")
    if dist.get_rank() == 1:
        raise KeyError("bad shard 7")
    dist.all_reduce(torch.ones(1))  # rank 0 waits here for a peer that never comes
    dist.barrier()


@pytest.mark.smoke
def test_function_raises_while_others_wait(no_leftovers: None) -> None:
    start = time.monotonic()
    with pytest.raises(DistributedRunError, match=r"^rank 1 on .* failed: KeyError: 'bad shard 7'") as info:
        Distributor(num_processes=2).run(fails_in_collective)
    assert time.monotonic() - start < 30
    assert isinstance(info.value.__cause__, KeyError)
    assert "Traceback from rank 1" in str(info.value) and "fails_in_collective" in str(info.value)


def exits_hard(code: int) -> None:
    if os.environ["RANK"] == "1":
        os._exit(code)
    time.sleep(600)


def kills_itself() -> None:
    if os.environ["RANK"] == "1":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(600)


def test_rank_os_exit(no_leftovers: None) -> None:
    with pytest.raises(DistributedRunError, match=r"^rank 1 on .* failed: exited with code 3"):
        Distributor(num_processes=2).run(exits_hard, 3)


def rank0_exits_without_a_result() -> None:
    os._exit(0)


def test_a_rank_0_that_wrote_no_result_raised_nothing(no_leftovers: None) -> None:
    """A rank 0 that exits 0 without its result failed, but raised no exception: the error says
    what happened and carries no invented cause."""
    with pytest.raises(DistributedRunError) as info:
        Distributor(num_processes=1).run(rank0_exits_without_a_result)
    assert str(info.value).startswith(
        "rank 0 on "
    ) and "failed: exited with code 0: it wrote no result (did the function call os._exit(0)?)" in str(info.value)
    assert info.value.__cause__ is None and info.value.failures[0].exc_type is None


@pytest.mark.parametrize("warm_start", [True, False], ids=["warm", "cold"])
def test_rank_sigkill(warm_start: bool, no_leftovers: None) -> None:
    """A rank killed by a signal is reported so, through its keeper (which ends as the rank did)."""
    start = time.monotonic()
    with pytest.raises(DistributedRunError, match=r"^rank 1 on .* failed: killed by SIGKILL"):
        Distributor(num_processes=2, warm_start=warm_start).run(kills_itself)
    assert time.monotonic() - start < 30


def unpicklable_result() -> object:
    import threading

    return threading.Lock()


def test_unpicklable_result(no_leftovers: None) -> None:
    with pytest.raises(DistributedRunError, match=r"rank 0 returned a lock that cannot be pickled"):
        Distributor(num_processes=1).run(unpicklable_result)


class OnlyOnRanks:
    """Unpickling this on the driver fails (as a class missing on the driver would)."""

    def __reduce__(self) -> tuple[object, ...]:
        return (_refuse, ())


def _refuse() -> None:
    if "SPARK_TORCH_RUN_ID" not in os.environ:
        raise ImportError("no module named 'rank_only_module'")


def returns_only_on_ranks() -> object:
    return OnlyOnRanks()


def test_result_not_unpicklable_on_driver(no_leftovers: None) -> None:
    with pytest.raises(DistributedRunError, match="cannot be unpickled on the driver"):
        Distributor(num_processes=1).run(returns_only_on_ranks)


def hangs() -> None:
    print("about to hang", flush=True)
    time.sleep(600)


def test_timeout(no_leftovers: None) -> None:
    from spark_torch import RunTimeoutError

    start = time.monotonic()
    with pytest.raises(RunTimeoutError, match=r"exceeded timeout=2s; ranks 0, 1 were still running") as info:
        Distributor(num_processes=2, timeout=2).run(hangs)
    assert isinstance(info.value, TimeoutError)
    assert not info.value.failures and [s.rank for s in info.value.stopped] == [0, 1]  # stopped, not failed
    assert "about to hang" in str(info.value) and "Stopped while still running: ranks 0, 1" in str(info.value)
    assert time.monotonic() - start < 15


def test_log_ranks_and_log_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str], no_leftovers: None) -> None:
    Distributor(num_processes=2, log_ranks=[0], log_dir=str(tmp_path)).run(env_and_allreduce, "t")
    out = capsys.readouterr().out
    assert "[rank 0] rank 0 done" in out and "[rank 1]" not in out
    assert "rank 1 done" in (tmp_path / "rank-1.log").read_text()
    assert {(p.name, p.stat().st_mode & 0o777) for p in tmp_path.glob("rank-*.log")} == {
        ("rank-0.log", 0o600),
        ("rank-1.log", 0o600),
    }


def test_a_link_planted_in_log_dir_is_refused(tmp_path: Path, no_leftovers: None) -> None:
    """A shared log_dir where someone planted ``rank-1.log`` as a link to a victim's file: the
    run refuses at once (nothing started), the victim's file keeps its content and mode."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    victim.chmod(0o644)
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "rank-1.log").symlink_to(victim)
    with pytest.raises(ConfigurationError, match=r"rank-1.log is a symbolic link; remove it or choose another log_dir"):
        Distributor(num_processes=2, log_dir=str(logs)).run(env_and_allreduce, "t")
    assert victim.read_text() == "precious\n" and victim.stat().st_mode & 0o777 == 0o644
    assert not (logs / "rank-0.log").exists() or (logs / "rank-0.log").read_text() == ""


@pytest.mark.timeout(60)  # a FIFO opened for writing without O_NONBLOCK blocks until a reader comes: for ever
@pytest.mark.parametrize("planted", ["a FIFO", "a FIFO with a reader", "a hard link"])
def test_a_fifo_or_a_hard_link_planted_in_log_dir_is_refused(tmp_path: Path, planted: str, no_leftovers: None) -> None:
    """``rank-1.log`` planted as a named pipe (it used to block the driver before anything
    started) or as a second name of a victim's file: refused at once, naming the path and the fix;
    the victim's file keeps its content and mode."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    victim.chmod(0o644)
    logs = tmp_path / "logs"
    logs.mkdir()
    target = logs / "rank-1.log"
    reader = None
    if planted == "a hard link":
        os.link(victim, target)
        says = "rank-1.log has 2 names (a hard link"
    else:
        os.mkfifo(target)
        says = "rank-1.log is a named pipe (FIFO), not a regular file"
        if planted == "a FIFO with a reader":  # with a reader the open succeeds: the check after it refuses
            reader = os.open(target, os.O_RDONLY | os.O_NONBLOCK)
            says = "rank-1.log is not a regular file of this user"
    try:
        with pytest.raises(
            ConfigurationError, match=rf"log_dir: {re.escape(f'{logs}/{says}')}.*; remove it or choose another log_dir"
        ):
            Distributor(num_processes=2, log_dir=str(logs)).run(env_and_allreduce, "t")
    finally:
        if reader is not None:
            os.close(reader)
    assert victim.read_text() == "precious\n" and victim.stat().st_mode & 0o777 == 0o644


def big_result(megabytes: int) -> bytes:
    return bytes(range(256)) * (megabytes * 4096)


def test_large_result_local(no_leftovers: None) -> None:
    out = Distributor(num_processes=1).run(big_result, 120)
    assert len(out) == 120 * 1024 * 1024 and out[:3] == b"\x00\x01\x02"


def test_rank_does_not_import_pyspark(no_leftovers: None) -> None:
    def check() -> bool:
        return "pyspark" in sys.modules

    assert Distributor(num_processes=1).run(check) is False


def leaves_group_open() -> float:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://")
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()  # no destroy_process_group(): common in user code


def test_function_that_leaves_process_group_open(no_leftovers: None) -> None:
    assert Distributor(num_processes=2).run(leaves_group_open) == 2.0


def resumes_from_checkpoint(checkpoint: str) -> dict[str, object]:
    """Fails on the first attempt after saving a checkpoint; resumes from it on the second."""
    restart = int(os.environ["SPARK_TORCH_RESTART_COUNT"])
    rank = int(os.environ["RANK"])
    path = f"{checkpoint}.{rank}"
    step = int(open(path).read()) if os.path.exists(path) else 0
    with open(path, "w") as fh:
        fh.write(str(step + 5))
    if restart == 0 and rank == 1:
        deadline = time.monotonic() + 30  # crash only once every rank saved its checkpoint
        while not os.path.exists(f"{checkpoint}.0") and time.monotonic() < deadline:
            time.sleep(0.01)
        raise RuntimeError("simulated crash after step 5")
    return {"restart": restart, "resumed_from": step, "run_id": os.environ["SPARK_TORCH_RUN_ID"]}


def test_max_restarts_resumes(tmp_path: Path, no_leftovers: None) -> None:
    out = Distributor(num_processes=2, max_restarts=2).run(resumes_from_checkpoint, str(tmp_path / "ckpt"))
    assert out["restart"] == 1 and out["resumed_from"] == 5 and len(out["run_id"]) == 12


def test_max_restarts_exhausted(tmp_path: Path, no_leftovers: None) -> None:
    with pytest.raises(DistributedRunError, match="simulated crash"):
        Distributor(num_processes=2, max_restarts=0).run(resumes_from_checkpoint, str(tmp_path / "ckpt"))


def registers_atexit(path: str) -> int:
    import atexit

    atexit.register(lambda: open(f"{path}.{os.environ['RANK']}", "w").write("bye"))
    return 1


def test_atexit_handlers_run_despite_fast_exit(tmp_path: Path, no_leftovers: None) -> None:
    assert Distributor(num_processes=2).run(registers_atexit, str(tmp_path / "done")) == 1
    assert (tmp_path / "done.0").read_text() == "bye" and (tmp_path / "done.1").read_text() == "bye"


def _secret_env() -> dict[str, str]:
    # the node's marker token (SPARK_TORCH_NODE_TOKEN) is no credential: it names the attempt's
    # processes so that a stop reaches only them, and every rank carries it by design
    return {k: v for k, v in os.environ.items() if ("SECRET" in k or "TOKEN" in k) and k != "SPARK_TORCH_NODE_TOKEN"}


def test_spark_secrets_do_not_reach_ranks(no_leftovers: None) -> None:
    """Spark's own secrets (spark.authenticate's _SPARK_AUTH_SECRET, Py4J's, a Connect token)
    are scrubbed; the user's own variables (e.g. a cloud key) are not."""
    os.environ.update(
        {
            "_SPARK_AUTH_SECRET": "spark-auth",
            "PYSPARK_GATEWAY_SECRET": "py4j",
            "SPARK_CONNECT_AUTHENTICATE_TOKEN": "connect",
            "MY_API_SECRET": "mine",
        }
    )  # restored by the autouse _restore_environ fixture
    seen = Distributor(num_processes=1).run(_secret_env)
    assert seen == {"MY_API_SECRET": "mine"}


def test_a_store_host_that_never_said_ready_does_not_keep_rank_0_off_the_port(
    monkeypatch: Any, no_leftovers: None
) -> None:
    """A store host slow to start under load may still come up on the reserved port after
    node 0 gave up on it: rank 0 then hosts the store on a fresh port, not the taken one."""
    import socket

    from spark_torch.node import lifecycle as node_host

    squatters: list[socket.socket] = []

    def late_store_host(run: Any, port: int, cwd: Any, host: str = "127.0.0.1") -> None:
        late = socket.socket()  # what a late store host does: listen on the port
        late.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        late.bind((host, port))
        late.listen()
        squatters.append(late)
        return None  # ... after node 0 stopped waiting for it

    monkeypatch.setattr(node_host, "start_store_host", late_store_host)
    try:
        assert Distributor(num_processes=2, warm_start=True, log_ranks=[]).run(_world_sum) == 3
    finally:
        for late in squatters:
            late.close()
    assert squatters


def _world_sum() -> int:
    import os

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://")
    t = torch.tensor([float(os.environ["RANK"]) + 1])
    dist.all_reduce(t)
    dist.destroy_process_group()
    return int(t.item())
