"""Rank 0 hosting the rendezvous store itself (spark_torch.rank.store): only when its node says so,
on MASTER_ADDR only, the variable gone before the user's code; a port it cannot bind leaves
torch's own server to try, with a line that says why."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator

import psutil
import pytest

from spark_torch.rank import store


@pytest.fixture
def rank_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    yield monkeypatch
    store._hosted.clear()


def test_nothing_is_hosted_unless_the_node_asked(rank_env: pytest.MonkeyPatch) -> None:
    rank_env.setenv("MASTER_PORT", "1")
    rank_env.delenv("SPARK_TORCH_HOST_STORE", raising=False)
    assert store.host_rendezvous_store() is False
    assert "TORCHELASTIC_USE_AGENT_STORE" not in os.environ and store._hosted == []


def test_the_store_listens_on_master_addr_only(rank_env: pytest.MonkeyPatch) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    rank_env.setenv("MASTER_PORT", str(port))
    rank_env.setenv("SPARK_TORCH_HOST_STORE", "1")
    assert store.host_rendezvous_store() is True
    assert "SPARK_TORCH_HOST_STORE" not in os.environ  # the user's code never sees it
    assert os.environ["TORCHELASTIC_USE_AGENT_STORE"] == "True"  # init_process_group(env://) connects as a client
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    client = TCPStore("127.0.0.1", port, 2, False)
    client.set("k", "v")
    assert store._hosted[0].get("k") == b"v"
    listening = [
        c.laddr.ip
        for c in psutil.Process().net_connections("inet")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port
    ]
    assert listening == ["127.0.0.1"], listening  # torch's own server would listen on "::" or "0.0.0.0"


def test_a_taken_port_leaves_torchs_server_to_try_and_says_why(
    rank_env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        rank_env.setenv("MASTER_PORT", str(taken.getsockname()[1]))
        rank_env.setenv("SPARK_TORCH_HOST_STORE", "1")
        assert store.host_rendezvous_store() is False
    err = capsys.readouterr().err
    assert "rank 0 could not host the rendezvous store on its node's address" in err and "every interface" in err
    assert "SPARK_TORCH_HOST_STORE" not in os.environ and "TORCHELASTIC_USE_AGENT_STORE" not in os.environ
