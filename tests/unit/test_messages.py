"""The channel's messages (:mod:`spark_torch.channel.messages`) without a channel: every message
goes through a real encrypted frame and comes back equal; its wire form is the one the other
end reads; an unknown kind, several kinds, a payload of the wrong shape and a hello of another
protocol version are each refused with a message that names what was wrong and the fix."""

from __future__ import annotations

import ast
import socket
from pathlib import Path
from typing import Any

import pytest

from spark_torch import channel
from spark_torch.base.states import GroupState, RankState, StopReason
from spark_torch.channel import messages as m
from spark_torch.channel import wire
from spark_torch.errors import RankFailure
from spark_torch.shared.node_outcome import NodeOutcome
from spark_torch.shared.sealed import seal, unseal

SECRET = b"k" * 32
FAILED = NodeOutcome(
    state=GroupState.FAILED,
    ranks={0: RankState.FAILED},
    failures=(RankFailure(rank=0, host="h", exc_type="ValueError", exc_message="boom"),),
)

#: one message of every kind, with its wire form
SAMPLES: list[tuple[Any, dict[str, Any]]] = [
    (
        m.Lines(((0, "stdout", "a\nb"), (1, m.EVENT_STREAM, "started"))),
        {"lines": [[0, "stdout", "a\nb"], [1, "event", "started"]]},
    ),
    (m.Dropped(3), {"dropped": 3}),
    (m.Eof(2), {"eof": 2}),
    (m.Hello(1, {"port": 29500, "rows": 0}), {"hello": {"port": 29500, "rows": 0, "node": 1, "protocol": m.PROTOCOL}}),
    (m.GiveUp("cannot reach 10.0.0.1:4000"), {"give_up": "cannot reach 10.0.0.1:4000"}),
    (m.GiveUp(None), {"give_up": None}),
    (
        m.Report({"node": 0, "step": 1, "metrics": {"loss": 0.5}}),
        {"report": {"node": 0, "step": 1, "metrics": {"loss": 0.5}}},
    ),
    (m.Outcome(seal(0, FAILED, SECRET)), {"outcome": seal(0, FAILED, SECRET)}),
    (m.Progress(({"rank": 0, "text": "main"},)), {"progress": [{"rank": 0, "text": "main"}]}),
    (m.Trace(3, b"\x00trace"), {"trace": {"rank": 3}, "_bytes": b"\x00trace"}),
    (m.Bulk({"offset": 0}, b"\x01\x02"), {"bulk": {"offset": 0}, "_bytes": b"\x01\x02"}),
    (
        m.Rendezvous(peers=({"port": 1, "node": 0}, {"port": 2, "node": 1})),
        {"rendezvous": {"decision": "peers", "peers": [{"port": 1, "node": 0}, {"port": 2, "node": 1}]}},
    ),
    (
        m.Rendezvous(reason="node 1 gave up waiting"),
        {"rendezvous": {"decision": "fallback", "reason": "node 1 gave up waiting"}},
    ),
    (m.Stop(StopReason.STALLED), {"stop": "stalled"}),
    (m.Reported(4, None), {"reported": {"step": 4, "error": None}}),
    (m.Reported(5, "disk full"), {"reported": {"step": 5, "error": "disk full"}}),
    (m.Traces(stopping=True), {"traces": "stopping"}),
    (m.Traces(), {"traces": True}),
    (m.BulkError("OSError: no space left"), {"bulk_error": "OSError: no space left"}),
]


def _decode(message: Any, wire_form: dict[str, Any]) -> Any:
    node = type(message) in m.NODE_MESSAGES
    return (m.decode_node_message if node else m.decode_driver_message)(wire_form)


def _through_a_frame(wire_form: dict[str, Any]) -> dict[str, Any]:
    """What the far end's Link.recv() gives for ``wire_form`` (a real encrypted frame)."""
    a, b = socket.socketpair()
    keys = (b"c" * wire.KEY_BYTES, b"s" * wire.KEY_BYTES)
    sender, receiver = wire.Link(a, keys, server=False, idle_timeout=5), wire.Link(b, keys, server=True, idle_timeout=5)
    try:
        sender.send({**wire_form, "seq": 7})
        return receiver.recv()
    finally:
        sender.close()
        receiver.close()


def test_the_samples_cover_every_kind_and_no_kind_is_a_transport_key() -> None:
    kinds = [*m.NODE_MESSAGES, *m.DRIVER_MESSAGES]
    assert {type(message) for message, _ in SAMPLES} == set(kinds), "a kind of message without a sample here"
    names = [kind.KIND for kind in kinds]
    assert len(set(names)) == len(names), "two kinds share a name"
    assert not set(names) & {"seq", "_bytes", "attach", "ack", "ping", "pong"}, "a kind named like a transport frame"


def _bytes_of(body: wire.Body) -> bytes:
    return body if isinstance(body, bytes) else body[0] + bytes(body[1])


@pytest.mark.parametrize(
    ("message", "wire_form"), SAMPLES, ids=lambda v: None if isinstance(v, dict) else type(v).__name__
)
def test_every_message_has_its_wire_form_and_comes_back_equal_through_a_frame(
    message: Any, wire_form: dict[str, Any]
) -> None:
    encoded = message.to_wire()
    assert _bytes_of(wire.encode(encoded)) == _bytes_of(wire.encode(wire_form)), "not the wire form the other end reads"
    received = _through_a_frame(encoded)
    assert received.pop("seq") == 7
    assert _decode(message, received) == message


@pytest.mark.parametrize(
    ("decode", "message", "sender"),
    [
        (m.decode_node_message, {"seq": 1, "frobnicate": {"x": 1}}, "node"),
        (m.decode_driver_message, {"frobnicate": 1}, "driver"),
        (m.decode_driver_message, {"hello": {"node": 0}}, "driver"),  # a node's kind, from the driver
        (m.decode_node_message, {"seq": 1, "stop": "timeout"}, "node"),  # the driver's kind, from a node
    ],
)
def test_an_unknown_kind_is_refused_naming_it_the_protocol_and_the_fix(
    decode: Any, message: dict[str, Any], sender: str
) -> None:
    kind = next(k for k in message if k != "seq")
    with pytest.raises(m.MessageError, match=f"an unknown message '{kind}' from the {sender}") as info:
        decode(message)
    assert f"channel protocol {m.PROTOCOL}" in str(info.value)
    assert "install the same spark_torch on the driver and the executors" in str(info.value)


@pytest.mark.parametrize("message", [{"seq": 1}, {"seq": 2, "give_up": None, "lines": []}, {"_bytes": b"x"}])
def test_a_message_naming_no_kind_or_several_is_refused(message: dict[str, Any]) -> None:
    with pytest.raises(m.MessageError, match="a message must name one kind, this one names"):
        m.decode_node_message(message)


MALFORMED_NODE = [
    ({"lines": "nope"}, "lines must be a list"),
    ({"lines": [["x", "stdout", "a"]]}, r"must be \[int, str, str\]"),
    ({"lines": [[True, "stdout", "a"]]}, r"must be \[int, str, str\]"),
    ({"lines": [[0, "stdout"]]}, r"must be \[rank, stream, block\]"),
    ({"lines": [[0, "event", "dancing"]]}, "ValueError: 'dancing' is not a valid RankState"),
    ({"dropped": "many"}, "dropped must be a non-negative int"),
    ({"dropped": -1}, "dropped must be a non-negative int"),
    ({"eof": "0"}, "eof must name the node"),
    ({"hello": [1]}, "a hello must be an object naming its node"),
    ({"hello": {"port": 1}}, "a hello must be an object naming its node"),
    ({"give_up": 5}, "give_up must be a string or null"),
    ({"report": [1]}, "a report must be an object"),
    ({"outcome": {"state": "failed"}}, "an outcome must be a sealed node end"),
    ({"outcome": "failed"}, "an outcome must be a sealed node end"),
    ({"progress": {"rank": 0}}, "progress must be a list"),
    ({"trace": {"rank": "0"}, "_bytes": b"x"}, "a trace must be an object naming its rank"),
    ({"trace": {"rank": 0}}, "a trace without its bytes"),
    ({"bulk": [0], "_bytes": b"x"}, "a bulk header must be an object"),
    ({"bulk": {"offset": 0}}, "a bulk piece without its bytes"),
]
MALFORMED_DRIVER = [
    ({"rendezvous": "peers"}, "a rendezvous decision must be an object"),
    ({"rendezvous": {"decision": "maybe"}}, "a rendezvous decision must be fallback, or peers"),
    ({"rendezvous": {"decision": "peers", "peers": [{"node": 1}]}}, "every node's hello in node order"),
    ({"reported": {"step": "4"}}, "reported must be an object with an int step"),
    ({"reported": 4}, "reported must be an object with an int step"),
    ({"traces": "yes"}, 'traces must be true or "stopping"'),
    ({"bulk_error": {"why": 1}}, "bulk_error must be a string"),
]


@pytest.mark.parametrize(
    ("message", "why"), MALFORMED_NODE, ids=lambda v: next(iter(v)) if isinstance(v, dict) else None
)
def test_a_malformed_node_message_is_refused_naming_its_kind(message: dict[str, Any], why: str) -> None:
    kind = next(k for k in message if k != "_bytes")
    with pytest.raises(m.MessageError, match=f"a malformed '{kind}' message: .*{why}"):
        m.decode_node_message({**message, "seq": 1})


@pytest.mark.parametrize(
    ("message", "why"), MALFORMED_DRIVER, ids=lambda v: next(iter(v)) if isinstance(v, dict) else None
)
def test_a_malformed_driver_message_is_refused_naming_its_kind(message: dict[str, Any], why: str) -> None:
    kind = next(iter(message))
    with pytest.raises(m.MessageError, match=f"a malformed '{kind}' message: .*{why}"):
        m.decode_driver_message(message)


def test_every_kind_has_a_malformed_case_where_it_checks_a_shape() -> None:
    """Stop reads any value (a reason this version does not know is None, as a newer driver's)."""
    covered = {next(k for k in message if k != "_bytes") for message, _ in MALFORMED_NODE + MALFORMED_DRIVER}
    assert covered == {kind.KIND for kind in (*m.NODE_MESSAGES, *m.DRIVER_MESSAGES)} - {"stop"}
    assert m.decode_driver_message({"stop": "a newer reason"}) == m.Stop(None)


@pytest.mark.parametrize(
    ("hello", "theirs"),
    [({"node": 2, "protocol": 99}, "channel protocol 99"), ({"node": 2}, "no channel protocol version")],
)
def test_a_hello_of_another_protocol_is_refused_naming_both_versions(hello: dict[str, Any], theirs: str) -> None:
    with pytest.raises(m.ProtocolMismatch) as info:
        m.decode_node_message({"hello": {**hello, "port": 1}, "seq": 1})
    assert str(info.value) == (
        f"node 2 speaks {theirs} and this driver speaks channel protocol {m.PROTOCOL}: the node runs other "
        "spark_torch code than the driver; install the same spark_torch on the driver and the executors"
    )
    assert isinstance(info.value, ValueError), (
        "the server closes the connection of a node whose message is a ValueError"
    )


def test_a_hello_hands_every_node_its_fields_and_node_only() -> None:
    hello = m.decode_node_message({"hello": {"port": 5, "node": 1, "protocol": m.PROTOCOL}, "seq": 1})
    assert isinstance(hello, m.Hello) and hello.peer() == {"port": 5, "node": 1}


def test_a_node_end_too_large_for_a_frame_is_cut_to_fit() -> None:
    """The sealed end of a node with many failed ranks fits one frame: the pickled exceptions stay
    behind first, then each rank's text is cut (head and tail kept)."""
    failures = tuple(
        RankFailure(
            rank=r,
            host="h",
            exc_type="ValueError",
            traceback="t" * 100_000 + f"\nValueError: {r}",
            last_lines=("y" * 60_000,) * 20,
        )
        for r in range(40)
    )
    outcome = NodeOutcome(GroupState.FAILED, failures=failures, pickled={r: "p" * 60_000 for r in range(40)})
    wire_form = m.Outcome(seal(3, outcome, SECRET, m.OUTCOME_ROOM)).to_wire()
    assert wire.body_size(wire.encode({**wire_form, "seq": 2**63})) < wire.MAX_FRAME
    decoded = m.decode_node_message(wire_form)
    assert isinstance(decoded, m.Outcome)
    node, opened = unseal(decoded.sealed, SECRET)
    assert node == 3 and not opened.pickled
    assert [(f.traceback or "")[-13:] for f in opened.failures] == [f"\nValueError: {r}"[-13:] for r in range(40)]


def _cases(path: Path, function: str) -> set[str]:
    """The message classes the ``match`` of ``function`` in ``path`` has a case for."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    body = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == function)
    match = next(n for n in ast.walk(body) if isinstance(n, ast.Match))
    named = set()
    for case in match.cases:
        pattern = (
            case.pattern.pattern if isinstance(case.pattern, ast.MatchAs) and case.pattern.pattern else case.pattern
        )
        if isinstance(pattern, ast.MatchClass) and isinstance(pattern.cls, ast.Name):
            named.add(pattern.cls.id)
    return named


@pytest.mark.parametrize(
    ("module", "function", "kinds"),
    [("driver_end.py", "message", m.NODE_MESSAGES), ("node_end.py", "_on_message", m.DRIVER_MESSAGES)],
)
def test_each_end_has_a_case_for_every_kind_it_receives(module: str, function: str, kinds: tuple[type, ...]) -> None:
    """What mypy checks too (the last case takes NoReturn), without running it."""
    assert _cases(Path(channel.__file__).parent / module, function) == {kind.__name__ for kind in kinds}
