"""Spark Connect: a client session runs distributed and local mode, and gets the ranks' logs."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from spark_torch import DistributedRunError, Distributor

from .sessions import stop_active


@pytest.fixture(scope="session")
def connect_spark(tmp_path_factory: Any) -> Iterator[Any]:
    """A Spark Connect server (local[2]) on loopback started from the pyspark package, and a client."""
    pytest.importorskip("grpc", reason="pyspark[connect] extras are not installed")
    home = os.environ["SPARK_HOME"]
    if not os.path.exists(f"{home}/sbin/start-connect-server.sh"):
        pytest.skip("this pyspark has no Spark Connect server (pip's pyspark 3.5 ships none)")
    stop_active()
    logs = tmp_path_factory.mktemp("connect")
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()  # Spark binds it itself; a race here only fails the fixture, loudly
    env = dict(os.environ, SPARK_NO_DAEMONIZE="1", SPARK_LOG_DIR=str(logs), SPARK_PID_DIR=str(logs))
    server = subprocess.Popen(
        [
            f"{home}/sbin/start-connect-server.sh",
            "--master",
            "local[2]",
            "--conf",
            f"spark.connect.grpc.binding.port={port}",
            "--conf",
            "spark.connect.grpc.binding.address=127.0.0.1",
            "--conf",
            "spark.driver.host=127.0.0.1",
            "--conf",
            "spark.ui.enabled=false",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    assert server.stdout is not None
    deadline = time.monotonic() + 180
    for line in server.stdout:
        if "Spark Connect server started" in line:
            break
        if time.monotonic() > deadline:
            break
    else:
        pytest.fail("the Spark Connect server did not start")
    # keep draining its output so the server never blocks on a full pipe
    import threading

    threading.Thread(target=lambda: shutil.copyfileobj(server.stdout, open(os.devnull, "w")), daemon=True).start()  # type: ignore[arg-type]
    from pyspark.sql import SparkSession

    spark = SparkSession.builder.remote(f"sc://127.0.0.1:{port}").getOrCreate()
    try:
        yield spark
    finally:
        spark.stop()
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def all_reduce_and_say(x: int) -> float:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://")
    t = torch.ones(1)
    dist.all_reduce(t)
    print(f"hello from {dist.get_rank()} via connect", flush=True)
    dist.destroy_process_group()
    return t.item() * x


@pytest.mark.slow
def test_connect_distributed_result_and_logs(connect_spark: Any, capsys: pytest.CaptureFixture[str]) -> None:
    assert Distributor(num_processes=2, local_mode=False, spark=connect_spark).run(all_reduce_and_say, 5) == 10.0
    out = capsys.readouterr().out
    assert "[rank 0] hello from 0 via connect" in out and "[rank 1] hello from 1 via connect" in out


@pytest.mark.slow
def test_connect_local_mode_runs_on_client(connect_spark: Any, no_leftovers: None) -> None:
    assert Distributor(num_processes=2, local_mode=True, spark=connect_spark).run(all_reduce_and_say, 2) == 4.0


def fail_on_rank1() -> None:
    if os.environ["RANK"] == "1":
        raise ValueError("connect failure")


@pytest.mark.slow
def test_connect_failure_report(connect_spark: Any) -> None:
    with pytest.raises(DistributedRunError, match=r"^rank 1 on .* failed: ValueError: connect failure"):
        Distributor(num_processes=2, local_mode=False, spark=connect_spark).run(fail_on_rank1)


@pytest.mark.slow
def test_connect_too_few_slots_fails_fast(connect_spark: Any) -> None:
    """A Connect client cannot ask the scheduler; the slots come from the server's conf
    (local[2] here) instead of Spark's ~10 minute barrier retry loop."""
    from spark_torch import InsufficientSlotsError

    start = time.monotonic()
    with pytest.raises(InsufficientSlotsError, match=r"needs 3 Spark task slots at once .* has 2"):
        Distributor(num_processes=3, local_mode=False, spark=connect_spark).run(all_reduce_and_say, 1)
    assert time.monotonic() - start < 30


@pytest.mark.slow
def test_connect_refuses_reuse_staged_before_anything_starts(connect_spark: Any, no_leftovers: None) -> None:
    """Kept rows would live on the Connect server's executors, past the user's session."""
    from spark_torch import ConfigurationError

    df = connect_spark.range(8).selectExpr("cast(id as double) as x")
    start = time.monotonic()
    with pytest.raises(ConfigurationError, match=r"reuse_staged=True needs a classic Spark session.*Drop reuse_staged"):
        Distributor(num_processes=2, local_mode=False, spark=connect_spark).run_on_dataframe(
            all_reduce_and_say, df, 1, reuse_staged=True
        )
    assert time.monotonic() - start < 30


def _cuda_visible() -> str | None:
    return os.environ.get("CUDA_VISIBLE_DEVICES")


@pytest.mark.slow
def test_connect_local_mode_uses_the_clients_gpus(connect_spark: Any, fake_nvidia_smi: str, no_leftovers: None) -> None:
    """With Spark Connect, local mode runs the ranks on the client: its GPUs count (found by
    nvidia-smi there), not the Connect server's driver resources."""
    assert Distributor(num_processes=2, use_gpu=True, spark=connect_spark).run(_cuda_visible) == "0,1"


@pytest.mark.slow
def test_connect_unreachable_channel_falls_back(
    connect_spark: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A Connect client whose advertised address the executors cannot reach (the 127.0.1.1 /
    container case): the run goes on through one allGather round after the deadline, with one
    warning naming the address; never a silent wait."""
    import logging

    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
    port = dead.getsockname()[1]
    monkeypatch.setenv("SPARK_TORCH_CHANNEL_HOST", f"127.0.0.1:{port}")
    # each node tries the channel until this deadline, then meets the others in one allGather round
    # within it again: the round needs both tasks, and at 3 s a loaded CI machine's second task came
    # too late for the first ("the allGather fallback did not complete within 3s")
    monkeypatch.setenv("SPARK_TORCH_RENDEZVOUS_TIMEOUT", "10")
    try:
        with caplog.at_level(logging.WARNING, logger="spark_torch"):
            out = Distributor(num_processes=2, local_mode=False, spark=connect_spark, timeout=120).run(
                all_reduce_and_say, 5
            )
    finally:
        dead.close()
    assert out == 10.0
    assert caplog.text.count("could not reach the driver's channel") == 1
    assert f"127.0.0.1:{port}" in caplog.text and "SPARK_TORCH_CHANNEL_HOST" in caplog.text


def test_connect_replica_groups_take_a_torchft_step(
    connect_spark: Any, caplog: pytest.LogCaptureFixture, no_leftovers: None
) -> None:
    """Replica groups from a Spark Connect client: the client cannot list the executors, so the
    lighthouse's gate hears any other machine, but admits only connections that prove the run's
    secret (the nodes' relays): nothing to warn about, and both groups' barrier jobs take a step
    through their nodes' relays."""
    pytest.importorskip("torchft")
    from tests import ft_programs

    with caplog.at_level(logging.WARNING, logger="spark_torch"):
        address, _, hellos = Distributor(
            num_processes=2, local_mode=False, replica_groups=2, spark=connect_spark, log_ranks=[]
        ).run(ft_programs.listeners_after_a_step)
    assert address.startswith("http://127.0.0.1:") and hellos["127.0.0.1"] == "answered"
    assert not [r.getMessage() for r in caplog.records if "lighthouse" in r.getMessage()]


def test_connect_executors_python_is_checked(connect_spark: Any) -> None:
    """The check before the barrier stage works through Spark Connect too (a plain Python UDF)."""
    from spark_torch.driver.spark import preflight

    facts = preflight._ask(connect_spark, 2, *preflight.node_modules(ship_package=True))
    assert isinstance(facts, list) and len(facts) == 2, facts
    assert {(f.executable, f.missing) for f in facts} == {(sys.executable, ())}
