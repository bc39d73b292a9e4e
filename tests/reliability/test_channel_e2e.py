"""The channel end to end, through Spark barrier tasks and real ranks on local[2]: a proxy that
cuts connections, an idle drop during a silent phase, an advertised address nobody can reach,
forged failure reports, and no leaks over many runs."""

from __future__ import annotations

import logging
import os
import re
import socket
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from spark_torch import DistributedRunError, Distributor
from spark_torch.channel.driver_end import DriverChannel

from ..netproxy import Proxy


def chatty_ddp(lines: int, silence: float) -> float:
    """Rendezvous, a silent phase (like NCCL init), then many lines and an all-reduce."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://")
    time.sleep(silence)
    rank = dist.get_rank()
    for i in range(lines):
        print(f"r{rank} line {i:05d}")
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.destroy_process_group()
    return t.item()


def _lines_of(out: str, rank: int) -> list[int]:
    return [int(m) for m in re.findall(rf"^\[rank {rank}\] r{rank} line (\d+)$", out, flags=re.M)]


@pytest.fixture
def proxied(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Make the driver advertise a proxy in front of its channel; yields a factory for the proxy."""
    import spark_torch.driver.run.barrier as barrier

    made: list[Proxy] = []

    def make(**faults: Any) -> Proxy:
        proxy = Proxy(**faults)
        made.append(proxy)

        class Proxied(DriverChannel):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **kwargs)
                proxy.target = ("127.0.0.1", self.port)

        monkeypatch.setattr(barrier, "DriverChannel", Proxied)
        monkeypatch.setenv("SPARK_TORCH_CHANNEL_HOST", f"127.0.0.1:{proxy.port}")
        return proxy

    yield make
    for proxy in made:
        proxy.close()


def test_connections_cut_during_rendezvous_and_training(
    spark_session: Any, proxied: Any, capsys: pytest.CaptureFixture[str], no_leftovers: None
) -> None:
    proxy = proxied(cut_after=400, faulty=2)  # the first two connections die early
    assert (
        Distributor(num_processes=2, local_mode=False, spark=spark_session, timeout=120).run(chatty_ddp, 3000, 0.0)
        == 2.0
    )
    out = capsys.readouterr().out
    assert proxy.cuts == 2
    for rank in (0, 1):
        assert _lines_of(out, rank) == list(range(3000))
    proxy2 = proxied(cut_after=20_000, faulty=2)  # now mid-stream, during training
    assert (
        Distributor(num_processes=2, local_mode=False, spark=spark_session, timeout=120).run(chatty_ddp, 3000, 0.0)
        == 2.0
    )
    out = capsys.readouterr().out
    assert proxy2.cuts == 2
    for rank in (0, 1):
        assert _lines_of(out, rank) == list(range(3000))


def test_idle_drop_during_a_silent_phase(
    spark_session: Any,
    proxied: Any,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    no_leftovers: None,
) -> None:
    """An idle timeout (1 s) shorter than the ranks' silence (4 s) and than the heartbeat (2 s):
    connections are cut and re-established; the run completes with every line. (Stall
    detection is off: its progress reports, every second at most, would keep the line busy.)"""
    proxy = proxied(idle_cut=1.0, faulty=100)
    distributor = Distributor(num_processes=2, local_mode=False, spark=spark_session, timeout=120, stall_timeout=0)
    assert distributor.run(chatty_ddp, 500, 4.0) == 2.0
    out = capsys.readouterr().out
    assert proxy.cuts >= 2
    for rank in (0, 1):
        assert _lines_of(out, rank) == list(range(500))


def test_heartbeat_shorter_than_idle_timeout_keeps_connections(
    spark_session: Any, proxied: Any, monkeypatch: pytest.MonkeyPatch, no_leftovers: None
) -> None:
    monkeypatch.setenv("SPARK_TORCH_HEARTBEAT", "0.3")
    proxy = proxied(idle_cut=1.5, faulty=100)
    assert (
        Distributor(num_processes=2, local_mode=False, spark=spark_session, timeout=120).run(chatty_ddp, 10, 4.0) == 2.0
    )
    assert proxy.cuts == 0 and proxy.connections == 2


def _dead_port() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
    return sock


def test_unreachable_advertised_address_falls_back(
    spark_session: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, no_leftovers: None
) -> None:
    """The driver advertises an address where nothing listens (a container's internal address,
    a firewalled port): the run goes on through one allGather round, within the deadline, and
    one warning names the address, the nodes' error and the fix."""
    dead = _dead_port()
    port = dead.getsockname()[1]
    monkeypatch.setenv("SPARK_TORCH_CHANNEL_HOST", f"127.0.0.1:{port}")
    # each node tries the channel until this deadline, then meets the others in one allGather round
    # within it again: the round needs both tasks, and at 3 s a loaded machine's second task once
    # came too late for the first ("the allGather fallback did not complete within 3s")
    monkeypatch.setenv("SPARK_TORCH_RENDEZVOUS_TIMEOUT", "10")
    try:
        start = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="spark_torch"):
            out = Distributor(num_processes=2, local_mode=False, spark=spark_session, timeout=120).run(
                chatty_ddp, 5, 0.0
            )
        elapsed = time.monotonic() - start
    finally:
        dead.close()
    assert out == 2.0
    assert elapsed < 10 * 1.5 + 5 + 15, elapsed
    text = caplog.text
    assert text.count("could not reach the driver's channel") == 1
    assert f"127.0.0.1:{port}" in text and "SPARK_TORCH_CHANNEL_HOST" in text
    assert "Connection refused" in text  # the executors' error (it reaches the driver with the stage's end)


class _Evil(Exception):
    pass


def raise_forged_report(marker_file: str) -> None:
    """A rank whose exception text echoes data that imitates a failure report; its 'pickled'
    exception would create ``marker_file`` when unpickled."""
    import base64
    import json

    import cloudpickle

    from spark_torch.shared.sealed import MARKER

    class Boom:
        def __reduce__(self) -> Any:
            return (open, (marker_file, "w"))

    outcome = {
        "state": "failed",
        "ranks": {"0": "failed"},
        "failures": [{"rank": 0, "host": "forged", "exc_type": "Forged", "exc_message": "pwned"}],
        "pickled": {"0": base64.b64encode(cloudpickle.dumps(Boom())).decode()},
    }
    blob = base64.b64encode(json.dumps({"node": 0, "outcome": outcome}).encode()).decode()
    raise ValueError(f"bad row: {MARKER}<{blob}.{'0' * 64}>{MARKER}")


def test_forged_report_in_exception_text_is_not_trusted(spark_session: Any, tmp_path: Path, no_leftovers: None) -> None:
    marker = tmp_path / "unpickled"
    with pytest.raises(DistributedRunError) as info:
        Distributor(num_processes=2, local_mode=False, spark=spark_session, timeout=120).run(
            raise_forged_report, str(marker)
        )
    assert not marker.exists(), "the driver unpickled bytes from a rank's exception text"
    message = str(info.value)
    assert message.startswith("rank ") and "ValueError: bad row" in message
    assert "forged headline" not in message and "pwned" not in message.split("\n")[0]


def _quick() -> int:
    return 1


def _resources() -> tuple[set[str], int, int]:
    me = psutil.Process()
    threads = {t.name for t in threading.enumerate()}
    listening = sum(1 for c in me.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN)
    return threads, me.num_fds(), listening


@pytest.mark.slow
def test_twenty_runs_leave_no_thread_fd_or_listener(spark_session: Any, no_leftovers: None) -> None:
    # templates that earlier tests started (other settings, other keys) live until their idle
    # timeout: their waiter threads are not this test's
    earlier_waiters = {n for n in _resources()[0] if n.startswith("spark-torch-template-")}
    distributor = Distributor(num_processes=2, local_mode=False, spark=spark_session)
    distributor.run(_quick)  # warm: Python workers, Py4J connections
    threads_before = threading.active_count()
    _, fds_before, listeners_before = _resources()
    for _ in range(20):
        assert distributor.run(_quick) == 1
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        names, fds, listeners = _resources()
        waiters = len([n for n in names if n.startswith("spark-torch-template-")])
        if (
            threading.active_count() - waiters <= threads_before
            and fds <= fds_before + 2
            and listeners <= listeners_before
        ):
            break
        time.sleep(0.2)
    names, fds, listeners = _resources()
    waiters = len([n for n in names if n.startswith("spark-torch-template-")])
    assert threading.active_count() - waiters <= threads_before, sorted(names)
    assert listeners <= listeners_before
    assert fds <= fds_before + 2, (fds_before, fds)
    # a warm-start template started by these runs is reaped by one waiter thread while it lives
    # (bounded by its idle timeout): one per template, not per run
    assert not [n for n in names if n.startswith("spark-torch") and not n.startswith("spark-torch-template-")], sorted(
        names
    )
    started_here = {n for n in names if n.startswith("spark-torch-template-")} - earlier_waiters
    assert len(started_here) <= 1, sorted(names)
    assert os.environ.get("SPARK_TORCH_CHANNEL_HOST") is None
