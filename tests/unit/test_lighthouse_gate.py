"""The gate in front of the run's torchft lighthouse: this user's connections from this machine and
the cluster's addresses from other machines pass through byte for byte; another user of this
machine (uid 65534, in a forked child) or another address is closed before a byte reaches what is
behind it; an unknown address asks for the cluster's addresses again at most once a second; idle
connections cost no thread each; nothing is left after close(). Loopback only: 127.0.0.2 and
127.0.0.3 are other addresses of the same machine, and "another machine" is the gate's user
lookup answering None."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Iterator

import psutil
import pytest

from spark_torch.ft.gate import REFRESH_SECONDS, AddressGate, _plain
from tests.outsiders import as_nobody


class Echo:
    """A backend on 127.0.0.1 that sends back what it reads, counting its connections."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.accepted = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            self.accepted += 1
            threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    @staticmethod
    def _echo(conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)

    def close(self) -> None:
        self.server.close()


@pytest.fixture
def echo() -> Iterator[Echo]:
    backend = Echo()
    yield backend
    backend.close()


def _connect(port: int, source: str, host: str = "127.0.0.1") -> socket.socket:
    client = socket.socket()
    client.bind((source, 0))
    client.settimeout(5)
    client.connect((host, port))
    return client


def _listening(host: str, port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex((host, port)) == 0


def _remote(conn: socket.socket) -> int | None:
    """The gate's user lookup, answering as for a connection from another machine."""
    return None


def _answer(client: socket.socket) -> bytes:
    try:
        return client.recv(100)
    except ConnectionResetError:
        return b""


def test_the_clusters_addresses_pass_through_byte_for_byte(echo: Echo) -> None:
    gate = AddressGate("127.0.0.3", ("127.0.0.1", echo.port), lambda: {"127.0.0.1"}, peer_uid=_remote)
    try:
        payload = os.urandom(1 << 20)
        with _connect(gate.port, "127.0.0.1", "127.0.0.3") as client:
            client.sendall(payload[:4])
            assert client.recv(4) == payload[:4]
            # both ends of the relay send each piece at once (Nagle's wait cost ~40 ms a gRPC call)
            ends = list(gate._relay._ends)
            assert gate.pipes == 1 and len(ends) == 2
            assert all(end.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for end in ends)
            client.sendall(payload[4:])
            client.shutdown(socket.SHUT_WR)
            received = bytearray()
            while chunk := client.recv(65536):
                received += chunk
        assert bytes(received) == payload[4:] and echo.accepted == 1
    finally:
        gate.close()


def _hello_as_nobody(port: int) -> bytes:
    with _connect(port, "127.0.0.1") as client:
        client.sendall(b"POST /replica/spark_torch_group_0/kill HTTP/1.1\r\n\r\n")
        return _answer(client)


def test_another_user_of_this_machine_is_closed_before_a_byte_reaches_the_backend(
    echo: Echo, caplog: pytest.LogCaptureFixture
) -> None:
    """From loopback, an address the cluster lists: this user's connection passes, uid 65534's is closed."""
    gate = AddressGate("127.0.0.1", ("127.0.0.1", echo.port), lambda: {"127.0.0.1"})
    try:
        with caplog.at_level(logging.WARNING, logger="spark_torch.ft.gate"):
            for _ in range(2):
                assert as_nobody(_hello_as_nobody, gate.port) == b""  # its recv would time out (5 s) if left open
        assert echo.accepted == 0
        refused = [r.getMessage() for r in caplog.records if "refused a connection" in r.getMessage()]
        assert refused == [
            "spark_torch: refused a connection to the run's torchft lighthouse from 127.0.0.1: user id 65534 of this "
            f"machine, not this run's ({os.geteuid()}: ranks on this machine run as the driver's user)"
        ]  # once per address and user
        for source in ("127.0.0.1", "127.0.0.2"):  # this user, from any address of the machine
            with _connect(gate.port, source) as mine:
                mine.sendall(b"ping")
                assert mine.recv(4) == b"ping"
    finally:
        gate.close()


def test_another_machines_address_outside_the_cluster_is_closed(echo: Echo, caplog: pytest.LogCaptureFixture) -> None:
    gate = AddressGate("127.0.0.1", ("127.0.0.1", echo.port), lambda: {"127.0.0.1"}, peer_uid=_remote)
    try:
        with caplog.at_level(logging.WARNING, logger="spark_torch.ft.gate"):
            for _ in range(2):
                with _connect(gate.port, "127.0.0.2") as stranger:
                    stranger.sendall(b"POST /replica/spark_torch_group_0/kill HTTP/1.1\r\n\r\n")
                    assert _answer(stranger) == b""
        assert echo.accepted == 0
        refused = [r.getMessage() for r in caplog.records if "refused a connection" in r.getMessage()]
        assert refused == [
            "spark_torch: refused a connection to the run's torchft lighthouse from 127.0.0.2: not one of the cluster's addresses"
        ]
    finally:
        gate.close()


def test_an_unknown_address_asks_again_at_most_once_a_second(echo: Echo) -> None:
    asked: list[float] = []
    cluster = {"127.0.0.1"}

    def addresses() -> set[str]:
        asked.append(time.monotonic())
        return set(cluster)

    now = [100.0]  # the gate's clock, moved by the test (not the machine's speed)
    gate = AddressGate("127.0.0.1", ("127.0.0.1", echo.port), addresses, clock=lambda: now[0], peer_uid=_remote)
    try:
        cluster.add("127.0.0.2")  # an executor that joined after the run began
        now[0] += REFRESH_SECONDS / 2
        assert not gate.admits("127.0.0.2") and len(asked) == 1  # asked at the start, under a second ago
        now[0] += REFRESH_SECONDS / 2
        assert gate.admits("127.0.0.2") and len(asked) == 2
        now[0] += REFRESH_SECONDS / 2
        assert not gate.admits("127.0.0.4") and not gate.admits("127.0.0.5") and len(asked) == 2
        with _connect(gate.port, "127.0.0.2") as joined:
            joined.sendall(b"ping")
            assert joined.recv(4) == b"ping"
    finally:
        gate.close()


def test_close_ends_every_connection_and_leaves_nothing(echo: Echo) -> None:
    gate = AddressGate("127.0.0.1", ("127.0.0.1", echo.port), lambda: {"127.0.0.1"})
    client = _connect(gate.port, "127.0.0.1")
    client.sendall(b"ping")
    assert client.recv(4) == b"ping"
    gate.close()
    gate.close()  # idempotent
    assert _answer(client) == b""
    client.close()
    assert not _listening("127.0.0.1", gate.port)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("spark-torch-lighthouse")]
    assert not [c for c in psutil.Process().net_connections("inet") if c.laddr.port == gate.port]


def test_idle_connections_cost_no_thread_each(echo: Echo) -> None:
    """300 idle connections passed through: one thread for all (it was two per connection)."""
    threads = psutil.Process().num_threads()
    gate = AddressGate("127.0.0.1", ("127.0.0.1", echo.port), lambda: {"127.0.0.1"})
    clients: list[socket.socket] = []
    try:
        for _ in range(300):
            clients.append(_connect(gate.port, "127.0.0.1"))
        deadline = time.monotonic() + 30
        while gate.pipes < 300:
            assert time.monotonic() < deadline, f"the gate passed {gate.pipes} of 300 connections through within 30 s"
            time.sleep(0.05)
        # the echo backend holds a thread per connection (300 here): count the gate's own threads
        gate_threads = [t for t in threading.enumerate() if t.name.startswith("spark-torch-lighthouse")]
        assert len(gate_threads) == 1, [t.name for t in gate_threads]
        assert psutil.Process().num_threads() - threads <= 301 + 5  # the echo's 300, the gate's 1, slack
        clients[-1].sendall(b"ping")
        assert clients[-1].recv(4) == b"ping"
    finally:
        for client in clients:
            client.close()
        gate.close()


def test_an_ipv4_address_mapped_into_ipv6_reads_as_ipv4() -> None:
    assert _plain("::ffff:10.0.0.5") == "10.0.0.5"
    assert (
        _plain("::1") == "::1" and _plain("127.0.0.1") == "127.0.0.1" and _plain("not an address") == "not an address"
    )


def test_strangers_are_logged_up_to_a_bound(
    echo: Echo, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A scan from many addresses does not grow the gate's memory or log without end."""
    import spark_torch.ft.gate as gate_module

    monkeypatch.setattr(gate_module, "MAX_LOGGED_STRANGERS", 1)
    gate = AddressGate("127.0.0.1", ("127.0.0.1", echo.port), lambda: {"127.0.0.1"}, peer_uid=_remote)
    try:
        with caplog.at_level(logging.WARNING, logger="spark_torch.ft.gate"):
            for source in ("127.0.0.2", "127.0.0.4"):
                with _connect(gate.port, source) as stranger:
                    try:
                        assert stranger.recv(1) == b""
                    except ConnectionResetError:
                        pass
        refused = [r.getMessage() for r in caplog.records if "refused a connection" in r.getMessage()]
        assert len(refused) == 1 and "127.0.0.2" in refused[0] and echo.accepted == 0
    finally:
        gate.close()
