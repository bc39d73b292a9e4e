"""A node's relay to the run's torchft lighthouse, and the gate with a secret it reaches: this
user's connections to the node's relay pass through to what is behind the gate byte for byte,
over a connection that proved the run's secret both ways; another user of the node's machine
(uid 65534) is closed by the relay, a bare connection to the gate (HTTP, a torchft hello) or one
with a wrong secret is closed by the gate, a peer that never answers the handshake is closed at
its deadline, each with a WARNING that says why; nothing reaches the backend then, and nothing
is left after close(). Loopback only: 127.0.0.3 plays the driver's address, and "another
machine" is the gate's user lookup answering None."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator

import psutil
import pytest

import spark_torch.ft.relay as relay_module
from spark_torch.channel.wire import ANSWER_BYTES, MAGIC, NONCE_BYTES, PROOF_BYTES
from spark_torch.ft.gate import AddressGate
from spark_torch.ft.node_relay import NodeRelay, gate_of, start_for
from tests.outsiders import as_nobody, torchft_hello
from tests.unit.test_lighthouse_gate import Echo, _answer, _connect, _listening, _remote

SECRET = b"s" * 32
HELLO = b"POST /replica/spark_torch_group_0/kill HTTP/1.1\r\n\r\n"


@pytest.fixture
def echo() -> Iterator[Echo]:
    backend = Echo()
    yield backend
    backend.close()


@pytest.fixture
def gate(echo: Echo) -> Iterator[AddressGate]:
    """The driver's gate with the run's secret; the relay's connections come from "another machine"."""
    opened = AddressGate("127.0.0.3", ("127.0.0.1", echo.port), lambda: {"127.0.0.1"}, peer_uid=_remote, secret=SECRET)
    yield opened
    opened.close()


def _eventually(what: str, check: Callable[[], bool], seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, f"{what}: not within {seconds:.0f} s"
        time.sleep(0.02)


def _refusals(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if "refused" in r.getMessage() or "could not reach" in r.getMessage()
    ]


def _by_side(caplog: pytest.LogCaptureFixture) -> tuple[list[str], list[str]]:
    """The gate's refusals and the node relay's, each in order."""
    gates = [r.getMessage() for r in caplog.records if r.name == "spark_torch.ft.gate"]
    relays = [r.getMessage() for r in caplog.records if r.name == "spark_torch.ft.node_relay"]
    return gates, relays


def _lighthouse_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("spark-torch-lighthouse")]


def test_this_users_connections_pass_through_the_node_and_the_gate_byte_for_byte(echo: Echo, gate: AddressGate) -> None:
    relay = NodeRelay(("127.0.0.3", gate.port), SECRET)
    try:
        assert relay.address == f"http://127.0.0.1:{relay.port}" and relay.variables() == {
            "TORCHFT_LIGHTHOUSE": relay.address
        }
        payload = os.urandom(1 << 20)
        with _connect(relay.port, "127.0.0.1") as client:
            client.sendall(payload[:4])
            assert client.recv(4) == payload[:4]
            assert relay.pipes == 1 and gate.pipes == 1 and echo.accepted == 1
            client.sendall(payload[4:])
            client.shutdown(socket.SHUT_WR)
            received = bytearray()
            while chunk := client.recv(65536):
                received += chunk
        assert bytes(received) == payload[4:]
        # many connections: the node's relay keeps two threads (its pipes and its dials), the gate one
        clients = [_connect(relay.port, "127.0.0.2") for _ in range(40)]
        for each in clients:
            each.sendall(b"ping")
        assert all(each.recv(4) == b"ping" for each in clients)
        assert sorted(_lighthouse_threads()) == [
            "spark-torch-lighthouse-gate",
            "spark-torch-lighthouse-node-relay",
            "spark-torch-lighthouse-node-relay-dialer",
        ]
        for each in clients:
            each.close()
    finally:
        relay.close()
        relay.close()  # idempotent
    assert not _listening("127.0.0.1", relay.port)
    assert _lighthouse_threads() == ["spark-torch-lighthouse-gate"]
    _eventually("the gate's pipes end with the relay's", lambda: gate.pipes == 0)


def _hello_as_nobody(port: int) -> bytes:
    with _connect(port, "127.0.0.1") as client:
        client.sendall(HELLO)
        return _answer(client)


def test_another_user_of_the_nodes_machine_is_closed_by_the_relay(
    echo: Echo, gate: AddressGate, caplog: pytest.LogCaptureFixture
) -> None:
    relay = NodeRelay(("127.0.0.3", gate.port), SECRET)
    try:
        with caplog.at_level(logging.WARNING, logger="spark_torch.ft"):
            for _ in range(2):
                assert as_nobody(_hello_as_nobody, relay.port) == b""
        assert echo.accepted == 0 and gate.pipes == 0
        assert _refusals(caplog) == [
            "spark_torch: the node's relay to the run's torchft lighthouse refused a connection from 127.0.0.1 of "
            f"user id 65534: only this run's user ({os.geteuid()}) may use it"
        ]
    finally:
        relay.close()


@pytest.mark.parametrize("remote", [True, False], ids=["another-machine", "this-machine"])
def test_a_bare_connection_to_the_gate_is_closed_before_a_byte_reaches_the_lighthouse(
    echo: Echo, caplog: pytest.LogCaptureFixture, remote: bool
) -> None:
    """A torchft client (or anything else) that talks without the handshake, from a cluster's
    address of another machine or from this machine as this user, gets the greeting and is closed."""
    peer_uid = _remote if remote else None
    extra = {"peer_uid": peer_uid} if peer_uid is not None else {}
    gate = AddressGate("127.0.0.3", ("127.0.0.1", echo.port), lambda: {"127.0.0.1"}, secret=SECRET, **extra)
    try:
        with caplog.at_level(logging.WARNING, logger="spark_torch.ft.gate"):
            with _connect(gate.port, "127.0.0.1", "127.0.0.3") as bare:
                bare.sendall((HELLO + b"\0" * ANSWER_BYTES)[:ANSWER_BYTES])  # an answer's size: the gate reads it all
                answer = b""
                while chunk := _answer(bare):
                    answer += chunk
        assert answer.startswith(MAGIC) and len(answer) == len(MAGIC) + NONCE_BYTES
        assert echo.accepted == 0
        assert _refusals(caplog) == [
            "spark_torch: refused a connection to the run's torchft lighthouse from 127.0.0.1: the peer did not "
            "prove the run's secret"
        ]
    finally:
        gate.close()


def test_a_relay_with_another_secret_is_closed_and_says_so(
    echo: Echo, gate: AddressGate, caplog: pytest.LogCaptureFixture
) -> None:
    relay = NodeRelay(("127.0.0.3", gate.port), b"w" * 32)
    try:
        with caplog.at_level(logging.WARNING, logger="spark_torch.ft"):
            with _connect(relay.port, "127.0.0.1") as client:
                client.sendall(b"ping")
                assert _answer(client) == b""
        assert echo.accepted == 0
        gates, relays = _by_side(caplog)
        assert gates == [
            "spark_torch: refused a connection to the run's torchft lighthouse from 127.0.0.1: the peer did not "
            "prove the run's secret"
        ]
        assert len(relays) == 1 and relays[0].startswith(
            "spark_torch: the node's relay could not reach the run's torchft lighthouse through the driver's gate at "
            f"127.0.0.3:{gate.port} within 10 s ("
        ), relays
        assert relays[0].endswith(
            "): the executors must reach the driver's address (spark.driver.host, SPARK_TORCH_CHANNEL_HOST) and the "
            "driver must be this run's"
        ), relays
    finally:
        relay.close()


def _impostor(server: socket.socket, heard: list[bytes]) -> None:
    """Greets like the driver's gate, takes any answer, sends a proof it cannot have made."""
    conn, _ = server.accept()
    with conn:
        conn.sendall(MAGIC + os.urandom(NONCE_BYTES))
        conn.settimeout(30)
        heard.append(conn.recv(ANSWER_BYTES))
        conn.sendall(os.urandom(PROOF_BYTES))
        heard.append(conn.recv(100))  # what the relay sends after: nothing, it closes


def test_a_gate_without_the_secret_is_not_trusted_by_the_relay(caplog: pytest.LogCaptureFixture) -> None:
    """A listener that pretends to be the driver's gate (it greets, but cannot prove the secret)
    gets no byte of the rank's, and the relay says so."""
    server = socket.create_server(("127.0.0.3", 0))
    heard: list[bytes] = []
    thread = threading.Thread(target=_impostor, args=(server, heard), daemon=True)
    thread.start()
    relay = NodeRelay(("127.0.0.3", server.getsockname()[1]), SECRET)
    try:
        with caplog.at_level(logging.WARNING, logger="spark_torch.ft.node_relay"):
            with _connect(relay.port, "127.0.0.1") as client:
                client.sendall(b"ping")
                assert _answer(client) == b""
        thread.join(30)
        assert len(heard[0]) == ANSWER_BYTES and heard[1] == b""  # its answer, then nothing of the rank's
        (message,) = _by_side(caplog)[1]
        assert "(the driver's channel did not prove the run's secret)" in message, message
    finally:
        relay.close()
        server.close()


def test_a_peer_that_never_answers_the_handshake_is_closed_at_its_deadline(
    echo: Echo, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(relay_module, "HANDSHAKE_SECONDS", 0.5)
    gate = AddressGate("127.0.0.3", ("127.0.0.1", echo.port), lambda: {"127.0.0.1"}, peer_uid=_remote, secret=SECRET)
    try:
        with caplog.at_level(logging.WARNING, logger="spark_torch.ft.gate"):
            with _connect(gate.port, "127.0.0.1", "127.0.0.3") as silent:
                silent.settimeout(30)
                heard = b""
                while chunk := _answer(silent):  # the greeting, then the end (within the deadline, not 30 s)
                    heard += chunk
        assert heard.startswith(MAGIC) and len(heard) == len(MAGIC) + NONCE_BYTES
        assert echo.accepted == 0 and gate._relay.handshakes == 0
        assert _refusals(caplog) == [
            "spark_torch: refused a connection to the run's torchft lighthouse from 127.0.0.1: it did not prove the "
            "run's secret within 0.5 s"
        ]
    finally:
        gate.close()


def test_a_gate_that_never_greets_makes_the_relay_give_up_and_say_where(caplog: pytest.LogCaptureFixture) -> None:
    silent = socket.create_server(("127.0.0.3", 0))  # accepts (the kernel's backlog), never speaks
    relay = NodeRelay(("127.0.0.3", silent.getsockname()[1]), SECRET, dial_seconds=0.5)
    try:
        with caplog.at_level(logging.WARNING, logger="spark_torch.ft.node_relay"):
            with _connect(relay.port, "127.0.0.1") as client:
                client.settimeout(30)
                assert _answer(client) == b""
        (message,) = _refusals(caplog)
        assert f"through the driver's gate at 127.0.0.3:{silent.getsockname()[1]} within 0.5 s (timed out" in message
    finally:
        relay.close()
        silent.close()
    assert not _lighthouse_threads()


def test_the_node_starts_a_relay_only_for_a_gate_with_a_secret() -> None:
    assert start_for({}, SECRET) is None
    assert start_for({"TORCHFT_LIGHTHOUSE": "http://127.0.0.3:9"}, b"") is None
    relay = start_for({"TORCHFT_LIGHTHOUSE": "http://127.0.0.3:9"}, SECRET)
    assert relay is not None and relay.gate == ("127.0.0.3", 9)
    relay.close()
    assert gate_of("http://[::1]:80") == ("::1", 80)
    with pytest.raises(ValueError, match="not a lighthouse address"):
        gate_of("127.0.0.1")


def test_a_flood_of_handshakes_is_bounded_per_address(echo: Echo, gate: AddressGate) -> None:
    """Pending handshakes from one address are bounded as the channel's are: a flood costs
    sockets up to that bound, and a relay still gets through once the flood's are a second old."""
    flood = [_connect(gate.port, "127.0.0.1", "127.0.0.3") for _ in range(200)]
    try:
        _eventually("the gate takes the flood's handshakes", lambda: gate._relay.handshakes >= 100)
        assert gate._relay.handshakes <= relay_module.MAX_PENDING_PER_TRUSTED_ADDRESS
        time.sleep(relay_module.MIN_HANDSHAKE_AGE)
        relay = NodeRelay(("127.0.0.3", gate.port), SECRET)
        try:
            with _connect(relay.port, "127.0.0.1") as client:
                client.sendall(b"ping")
                assert client.recv(4) == b"ping"
        finally:
            relay.close()
    finally:
        for each in flood:
            each.close()
    assert not [c for c in psutil.Process().net_connections("inet") if c.laddr.port == relay.port]


def test_a_lighthouse_with_a_secret_hears_torchft_only_through_a_relay() -> None:
    """The lighthouse of a distributed run: torchft's own client is heard through a node's relay,
    closed when it talks to the gate for the relays itself; the driver's own look at it is a
    gate on loopback (this user only); both gates gone after close()."""
    pytest.importorskip("torchft")
    from spark_torch.driver.api.manager_watch import ManagerWatch
    from spark_torch.ft.lighthouse import Lighthouse
    from tests.ft_programs import hello_from

    with Lighthouse("127.0.0.3", allowed=lambda: {"127.0.0.1"}, secret=SECRET) as lighthouse:
        gate = gate_of(lighthouse.address)
        assert lighthouse.host == "127.0.0.1" and gate == ("127.0.0.3", lighthouse.ranks_port) != ("127.0.0.3", 0)
        assert hello_from("127.0.0.1", f"http://127.0.0.1:{lighthouse.port}") == "answered"
        assert as_nobody(hello_from, "127.0.0.1", f"http://127.0.0.1:{lighthouse.port}") == "closed"
        assert torchft_hello(lighthouse.address, "spark_torch_group_0:0").startswith("RuntimeError: ")
        relay = NodeRelay(gate, SECRET)
        try:
            watch = ManagerWatch(lighthouse.host, lighthouse.port, 2).start()
            assert torchft_hello(relay.address, "spark_torch_group_0:0") == "joined"
            assert watch.stop() == [1]  # group 0's heartbeat arrived, through the relay
        finally:
            relay.close()
    for port in (lighthouse.port, lighthouse.ranks_port):
        assert not _listening("127.0.0.1", port) and not _listening("127.0.0.3", port)
    assert not _lighthouse_threads()
