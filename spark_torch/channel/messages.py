"""Every message the channel carries, one frozen dataclass each, with its wire form.

A message travels as a JSON object naming its kind as its one key (``{"stop": "timeout"}``);
the transport adds ``seq`` to a node's messages, and a binary payload travels raw under
``_bytes`` (:func:`spark_torch.channel.wire.encode`). ``to_wire`` makes that object,
:func:`decode_node_message` and :func:`decode_driver_message` read one back and refuse
anything else with :class:`MessageError` (a ``ValueError``): an unknown kind, several kinds,
a payload of the wrong shape. A node's :class:`Hello` carries :data:`PROTOCOL`; a hello of
another version is refused with :class:`ProtocolMismatch`, naming both.

node -> driver: :class:`Lines` (rank output and rank state changes), :class:`Dropped`,
:class:`Eof`, :class:`Hello`, :class:`GiveUp`, :class:`Report`, :class:`Outcome`,
:class:`Progress`, :class:`Trace`, :class:`Bulk`.
driver -> node: :class:`Rendezvous`, :class:`Stop`, :class:`Reported`, :class:`Traces`,
:class:`BulkError`.
The transport's own frames (``attach``, ``ack``, ``ping``, ``pong``) are
:mod:`spark_torch.channel.server`'s and :mod:`spark_torch.channel.client`'s.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, NoReturn, TypeAlias, cast

from spark_torch.base.states import RankState, StopReason
from spark_torch.channel.wire import MAX_FRAME
from spark_torch.shared.sealed import MARKER

__all__ = [
    "PROTOCOL",
    "EVENT_STREAM",
    "MessageError",
    "ProtocolMismatch",
    "Lines",
    "Dropped",
    "Eof",
    "Hello",
    "GiveUp",
    "Report",
    "Outcome",
    "OUTCOME_ROOM",
    "Progress",
    "Trace",
    "Bulk",
    "Rendezvous",
    "Stop",
    "Reported",
    "Traces",
    "BulkError",
    "NodeMessage",
    "DriverMessage",
    "NODE_MESSAGES",
    "DRIVER_MESSAGES",
    "decode_node_message",
    "decode_driver_message",
    "unreachable",
]

#: the version of this vocabulary: a node's hello says it, the driver refuses another
PROTOCOL = 2
#: pseudo stream of rank state changes (``started``/``finished``/``failed``) among the lines
EVENT_STREAM = "event"
#: keys the transport adds next to a message's kind
_TRANSPORT_KEYS = ("seq", "_bytes")
_FIX = "install the same spark_torch on the driver and the executors"


class MessageError(ValueError):
    """A message this version cannot read: an unknown kind, or a payload of the wrong shape."""


class ProtocolMismatch(MessageError):
    """A node's hello speaks another version of the channel's messages than this driver."""


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise MessageError(what)


# node -> driver
@dataclass(frozen=True)
class Lines:
    """Blocks of rank output: ``(rank, stream, block)``; on :data:`EVENT_STREAM` the block is a
    :class:`~spark_torch.base.states.RankState` value (rank -1: the node's own notes)."""

    KIND: ClassVar[str] = "lines"
    entries: tuple[tuple[int, str, str], ...]

    def to_wire(self) -> dict[str, Any]:
        return {self.KIND: self.entries}

    @classmethod
    def from_wire(cls, payload: Any, data: Any) -> Lines:
        _require(isinstance(payload, list), "lines must be a list")
        entries = []
        for entry in payload:  # checks inline: the bulk of the channel's traffic
            if not (isinstance(entry, list) and len(entry) == 3):
                raise MessageError("a lines entry must be [rank, stream, block]")
            rank, stream, block = entry
            if (
                isinstance(rank, bool)
                or not isinstance(rank, int)
                or not isinstance(stream, str)
                or not isinstance(block, str)
            ):
                raise MessageError("a lines entry must be [int, str, str]")
            if stream == EVENT_STREAM:
                RankState(block)  # an unknown rank state raises ValueError: malformed
            entries.append((rank, stream, block))
        return cls(tuple(entries))


@dataclass(frozen=True)
class Dropped:
    """How many lines the node dropped since it last said so (its queue was full)."""

    KIND: ClassVar[str] = "dropped"
    count: int

    def to_wire(self) -> dict[str, Any]:
        return {self.KIND: self.count}

    @classmethod
    def from_wire(cls, payload: Any, data: Any) -> Dropped:
        _require(_int(payload) and payload >= 0, "dropped must be a non-negative int")
        return cls(payload)


@dataclass(frozen=True)
class Eof:
    """The node's last line was sent (after everything it queued)."""

    KIND: ClassVar[str] = "eof"
    node: int

    def to_wire(self) -> dict[str, Any]:
        return {self.KIND: self.node}

    @classmethod
    def from_wire(cls, payload: Any, data: Any) -> Eof:
        _require(_int(payload), "eof must name the node (an int)")
        return cls(payload)


@dataclass(frozen=True)
class Hello:
    """A node's part of the rendezvous: ``fields`` (its port, Python, package...) handed to
    every node as ``{**fields, "node": node}`` (:meth:`peer`), and the version it speaks."""

    KIND: ClassVar[str] = "hello"
    node: int
    fields: Mapping[str, Any] = field(default_factory=dict)
    protocol: int = PROTOCOL

    def peer(self) -> dict[str, Any]:
        """What every node gets of this hello."""
        return {**self.fields, "node": self.node}

    def to_wire(self) -> dict[str, Any]:
        return {self.KIND: {**self.peer(), "protocol": self.protocol}}

    @classmethod
    def from_wire(cls, payload: Any, data: Any) -> Hello:
        _require(isinstance(payload, dict) and _int(payload.get("node")), "a hello must be an object naming its node")
        version = payload.get("protocol")
        if version != PROTOCOL:
            theirs = "no channel protocol version" if version is None else f"channel protocol {str(version)[:20]}"
            raise ProtocolMismatch(
                f"node {payload['node']} speaks {theirs} and this driver speaks channel protocol {PROTOCOL}: "
                f"the node runs other spark_torch code than the driver; {_FIX}"
            )
        fields = {k: v for k, v in payload.items() if k not in ("node", "protocol")}
        return cls(payload["node"], fields, version)


@dataclass(frozen=True)
class GiveUp:
    """The node hit its rendezvous deadline: decide now (and why it could not reach the driver)."""

    KIND: ClassVar[str] = "give_up"
    reason: str | None = None

    def to_wire(self) -> dict[str, Any]:
        return {self.KIND: self.reason}

    @classmethod
    def from_wire(cls, payload: Any, data: Any) -> GiveUp:
        _require(payload is None or isinstance(payload, str), "give_up must be a string or null")
        return cls(payload)


@dataclass(frozen=True)
class Report:
    """The node's report of one report() step, or of ranks that ended (its content is the
    reporting layer's: :class:`~spark_torch.channel.protocols.StepSink` checks it)."""

    KIND: ClassVar[str] = "report"
    report: Mapping[str, Any]

    def to_wire(self) -> dict[str, Any]:
        return {self.KIND: self.report}

    @classmethod
    def from_wire(cls, payload: Any, data: Any) -> Report:
        _require(isinstance(payload, dict), "a report must be an object")
        return cls(payload)


#: the most characters of a sealed outcome one message carries (a frame, less the transport's keys)
OUTCOME_ROOM = MAX_FRAME - 256


@dataclass(frozen=True)
class Outcome:
    """How the node's part ended: its :class:`~spark_torch.shared.node_outcome.NodeOutcome`
    sealed with the run's secret (:func:`~spark_torch.shared.sealed.seal`, as in its task's rows
    and exception: the driver opens it with :func:`~spark_torch.shared.sealed.unseal`). Sent at
    once when a rank fails (that failure only), and before the node's last line."""

    KIND: ClassVar[str] = "outcome"
    sealed: str

    def to_wire(self) -> dict[str, Any]:
        return {self.KIND: self.sealed}

    @classmethod
    def from_wire(cls, payload: Any, data: Any) -> Outcome:
        _require(
            isinstance(payload, str) and payload.startswith(MARKER) and len(payload) <= OUTCOME_ROOM,
            "an outcome must be a sealed node end",
        )
        return cls(payload)


@dataclass(frozen=True)
class Progress:
    """The node's ranks' progress and stacks (stall detection; :mod:`spark_torch.shared.stacks`)."""

    KIND: ClassVar[str] = "progress"
    stacks: tuple[Any, ...]

    def to_wire(self) -> dict[str, Any]:
        return {self.KIND: self.stacks}

    @classmethod
    def from_wire(cls, payload: Any, data: Any) -> Progress:
        _require(isinstance(payload, list), "progress must be a list")
        return cls(tuple(payload))


@dataclass(frozen=True)
class Trace:
    """A rank's Flight Recorder trace: raw bytes, never unpickled by the channel."""

    KIND: ClassVar[str] = "trace"
    rank: int
    data: bytes | memoryview

    def to_wire(self) -> dict[str, Any]:
        return {self.KIND: {"rank": self.rank}, "_bytes": self.data}

    @classmethod
    def from_wire(cls, payload: Any, data: Any) -> Trace:
        _require(isinstance(payload, dict) and _int(payload.get("rank")), "a trace must be an object naming its rank")
        _require(data is not None, "a trace without its bytes")
        return cls(payload["rank"], data)


@dataclass(frozen=True)
class Bulk:
    """One piece of the node's bulk data, e.g. rank 0's result (its header is the
    :class:`~spark_torch.channel.protocols.BulkSink`'s to check)."""

    KIND: ClassVar[str] = "bulk"
    header: Mapping[str, Any]
    data: bytes | memoryview

    def to_wire(self) -> dict[str, Any]:
        return {self.KIND: self.header, "_bytes": self.data}

    @classmethod
    def from_wire(cls, payload: Any, data: Any) -> Bulk:
        _require(isinstance(payload, dict), "a bulk header must be an object")
        _require(data is not None, "a bulk piece without its bytes")
        return cls(payload, data)


# driver -> node
#: the two decisions of a rendezvous, on the wire
_PEERS = "peers"
_FALLBACK = "fallback"


@dataclass(frozen=True)
class Rendezvous:
    """The driver's one decision: every node's hello in node order (``peers``), or fall back to
    Spark's allGather (``peers`` None) and why."""

    KIND: ClassVar[str] = "rendezvous"
    peers: tuple[Mapping[str, Any], ...] | None = None
    reason: str = ""

    def to_wire(self) -> dict[str, Any]:
        if self.peers is None:
            return {self.KIND: {"decision": _FALLBACK, "reason": self.reason}}
        return {self.KIND: {"decision": _PEERS, "peers": self.peers}}

    @classmethod
    def from_wire(cls, payload: Any, data: Any) -> Rendezvous:
        _require(isinstance(payload, dict), "a rendezvous decision must be an object")
        if payload.get("decision") == _FALLBACK:
            return cls(reason=str(payload.get("reason", "")))
        peers = payload.get("peers")
        _require(
            payload.get("decision") == _PEERS
            and isinstance(peers, list)
            and all(isinstance(p, dict) and p.get("node") == i for i, p in enumerate(peers)),
            "a rendezvous decision must be fallback, or peers: every node's hello in node order",
        )
        return cls(peers=tuple(peers))


@dataclass(frozen=True)
class Stop:
    """Stop the ranks now, and why (None: a reason this version does not know)."""

    KIND: ClassVar[str] = "stop"
    reason: StopReason | None

    def to_wire(self) -> dict[str, Any]:
        return {self.KIND: None if self.reason is None else self.reason.value}

    @classmethod
    def from_wire(cls, payload: Any, data: Any) -> Stop:
        return cls(StopReason.parse(payload))


@dataclass(frozen=True)
class Reported:
    """Report step ``step`` is persisted on every node (or failed with ``error``)."""

    KIND: ClassVar[str] = "reported"
    step: int
    error: str | None = None

    def to_wire(self) -> dict[str, Any]:
        return {self.KIND: {"step": self.step, "error": self.error}}

    @classmethod
    def from_wire(cls, payload: Any, data: Any) -> Reported:
        _require(isinstance(payload, dict) and _int(payload.get("step")), "reported must be an object with an int step")
        error = payload.get("error")
        return cls(payload["step"], str(error) if error else None)


@dataclass(frozen=True)
class Traces:
    """Send the ranks' Flight Recorder traces (a stall); ``stopping``: they are about to be stopped."""

    KIND: ClassVar[str] = "traces"
    stopping: bool = False

    def to_wire(self) -> dict[str, Any]:
        return {self.KIND: "stopping" if self.stopping else True}

    @classmethod
    def from_wire(cls, payload: Any, data: Any) -> Traces:
        _require(payload is True or payload == "stopping", 'traces must be true or "stopping"')
        return cls(payload == "stopping")


@dataclass(frozen=True)
class BulkError:
    """The driver could not take this node's bulk data, and why."""

    KIND: ClassVar[str] = "bulk_error"
    error: str

    def to_wire(self) -> dict[str, Any]:
        return {self.KIND: self.error}

    @classmethod
    def from_wire(cls, payload: Any, data: Any) -> BulkError:
        _require(isinstance(payload, str), "bulk_error must be a string")
        return cls(payload[:2000] or "unknown error")


#: what a node says
NodeMessage: TypeAlias = Lines | Dropped | Eof | Hello | GiveUp | Report | Outcome | Progress | Trace | Bulk
#: what the driver says
DriverMessage: TypeAlias = Rendezvous | Stop | Reported | Traces | BulkError
NODE_MESSAGES: tuple[type[NodeMessage], ...] = (
    Lines,
    Dropped,
    Eof,
    Hello,
    GiveUp,
    Report,
    Outcome,
    Progress,
    Trace,
    Bulk,
)
DRIVER_MESSAGES: tuple[type[DriverMessage], ...] = (Rendezvous, Stop, Reported, Traces, BulkError)
_NODE: dict[str, Callable[[Any, Any], NodeMessage]] = {kind.KIND: kind.from_wire for kind in NODE_MESSAGES}
_DRIVER: dict[str, Callable[[Any, Any], DriverMessage]] = {kind.KIND: kind.from_wire for kind in DRIVER_MESSAGES}


def _decode(message: Mapping[str, Any], kinds: Mapping[str, Callable[[Any, Any], Any]], sender: str) -> Any:
    named = [key for key in message if key not in _TRANSPORT_KEYS]
    if len(named) != 1:
        raise MessageError(f"a message must name one kind, this one names {sorted(named)[:5]}")
    kind = named[0]
    decode = kinds.get(kind)
    if decode is None:
        raise MessageError(
            f"an unknown message {kind[:40]!r} from the {sender} (this side speaks channel protocol {PROTOCOL}): "
            f"the {sender} runs other spark_torch code; {_FIX}"
        )
    try:
        return decode(message[kind], message.get("_bytes"))
    except ProtocolMismatch:
        raise
    except MessageError as exc:
        raise MessageError(f"a malformed {kind!r} message: {exc}") from None
    except (ValueError, TypeError, KeyError) as exc:  # a payload's own parser (a rank state, a stop reason)
        raise MessageError(f"a malformed {kind!r} message: {type(exc).__name__}: {exc}") from None


def decode_node_message(message: Mapping[str, Any]) -> NodeMessage:
    """A node's message as the driver received it; raises :class:`MessageError`."""
    return cast(NodeMessage, _decode(message, _NODE, "node"))


def decode_driver_message(message: Mapping[str, Any]) -> DriverMessage:
    """The driver's message as a node received it; raises :class:`MessageError`."""
    return cast(DriverMessage, _decode(message, _DRIVER, "driver"))


def unreachable(message: NoReturn) -> NoReturn:
    """The last case of a dispatch by kind: mypy fails there when a kind has no case of its own."""
    raise AssertionError(f"a message of no known kind: {message!r}")
