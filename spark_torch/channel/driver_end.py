"""The driver's end of one run's channel: rank output in, the rendezvous, stops, reports, bulk data.

When the bulk sink fails (e.g. the driver's disk is full), the node is told (``bulk_error``, also
replayed when it reconnects), so that its ``send_bulk``/``drain`` fail and it sends the data
another way; the error is logged at ERROR once per node, and that node's later pieces are not
handed to the sink."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable
from typing import Any

from spark_torch.base.states import StopReason
from spark_torch.channel.log_stream import LineReceiver
from spark_torch.channel.messages import (
    Bulk,
    BulkError,
    DriverMessage,
    Dropped,
    Eof,
    GiveUp,
    Hello,
    Lines,
    MessageError,
    Outcome,
    Progress,
    Report,
    Reported,
    Stop,
    Trace,
    Traces,
    decode_node_message,
    unreachable,
)
from spark_torch.channel.protocols import BulkSink, StepSink
from spark_torch.channel.rendezvous import GIVE_UP_SECONDS, RendezvousCoordinator, fallback_warning
from spark_torch.channel.server import ChannelServer
from spark_torch.channel.transport import RateLimitedLog
from spark_torch.shared.lines import RankOutput
from spark_torch.shared.node_outcome import NodeOutcome
from spark_torch.shared.sealed import SealError, unseal
from spark_torch.shared.spec import ChannelSpec

__all__ = ["DriverChannel", "new_secret"]

logger = logging.getLogger(__name__)


def new_secret() -> bytes:
    """A fresh per-run key."""
    return os.urandom(32)


class DriverChannel:
    """The driver's end of one run: receives rank output, runs the rendezvous, stops nodes.

    Listens on ``bind_host`` (a port of ``ports``, or one the OS picks); nodes are told
    ``advertise_host`` (and ``advertise_port``, default the bound port) through :attr:`spec`.
    ``trusted_hosts`` are the IP addresses the nodes are expected to connect from (the executors
    the driver knows): a flood of strangers cannot keep their handshakes out.
    """

    def __init__(
        self,
        sink: RankOutput,
        *,
        nodes: int,
        bind_host: str,
        advertise_host: str,
        secret: bytes,
        advertise_port: int | None = None,
        ports: tuple[int, int] | None = None,
        heartbeat: float = 2.0,
        rendezvous_timeout: float = 60.0,
        trusted_hosts: Iterable[str] = (),
        reports: StepSink | None = None,
        bulk_sink: BulkSink | None = None,
        on_progress: Callable[[int, Any], None] | None = None,
        on_trace: Callable[[Any, bytes], None] | None = None,
        on_outcome: Callable[[int, NodeOutcome], None] | None = None,
    ) -> None:
        self._nodes = nodes
        #: report() of the ranks
        self.reports = reports
        #: how each node's part ended, as the node said (a failed rank at once, then the node's end)
        self.outcomes: dict[int, NodeOutcome] = {}
        #: where the nodes' bulk data goes (rank 0's result)
        self.bulk_sink = bulk_sink
        #: receives each node's progress snapshots (stall detection)
        self.on_progress = on_progress
        #: receives a rank's Flight Recorder trace: (rank as the node said, bytes never unpickled)
        self.on_trace = on_trace
        #: receives each node's end as it arrives (a failed rank's at once, before the node's own end)
        self.on_outcome = on_outcome
        self._receiver = LineReceiver(sink)
        self._coordinator = RendezvousCoordinator(nodes)
        self._lock = threading.Condition()
        self._stop_reason: StopReason | None = None
        self._attached: set[int] = set()
        self._finished: set[int] = set()
        self._warned = False
        #: per node, why the bulk sink failed (the node was told; later pieces are not handed on)
        self._bulk_errors: dict[int, str] = {}
        self._bulk_log = RateLimitedLog(logger, logging.ERROR)
        self._server = ChannelServer(
            bind_host, secret, self, nodes=nodes, ports=ports, heartbeat=heartbeat, trusted=trusted_hosts
        )
        self.spec = ChannelSpec(
            host=advertise_host,
            port=advertise_port or self._server.port,
            secret=secret,
            heartbeat=heartbeat,
            rendezvous_timeout=rendezvous_timeout,
        )
        self._expiry: threading.Timer | None = None

    @property
    def port(self) -> int:
        """The port actually bound."""
        return self._server.port

    @property
    def connected_nodes(self) -> set[int]:
        """The nodes connected right now."""
        return self._server.connected()

    @property
    def refused(self) -> int:
        """Handshakes turned away because their slots were full."""
        return self._server.refused

    @property
    def evicted(self) -> int:
        """Older handshakes closed to make room for a newcomer."""
        return self._server.evicted

    @property
    def rejected(self) -> int:
        """Connections refused (failed authentication, too many at once, bad attach)."""
        return self._server.rejected

    @property
    def dropped(self) -> int:
        """Lines the nodes dropped because their queue was full."""
        return self._receiver.dropped

    # ServerHandler
    def attached(self, node: int) -> list[dict[str, Any]]:
        """Replay the state a (re)connecting node must know."""
        with self._lock:
            self._attached.add(node)
            stop = self._stop_reason
            bulk_error = self._bulk_errors.get(node)
        replay: list[DriverMessage] = []
        if bulk_error is not None:  # the node may not have heard it before its connection dropped
            replay.append(BulkError(bulk_error))
        if self._coordinator.decision is not None:
            replay.append(self._coordinator.decision)
        if stop is not None:
            replay.append(Stop(stop))
        if self.reports is not None and self.reports.last_answer is not None:
            replay.append(Reported(*self.reports.last_answer))
        return [message.to_wire() for message in replay]

    def message(self, node: int, message: dict[str, Any]) -> None:
        """One numbered message of a node, exactly once; raises
        :class:`~spark_torch.channel.messages.MessageError` (a ``ValueError``: the server closes
        the connection) for one this version cannot read."""
        match decode_node_message(message):
            case Lines() as lines:
                self._receiver.lines(lines)
            case Hello() as hello:
                decision = self._coordinator.hello(node, hello)
                if decision is not None:
                    self._server.broadcast(decision.to_wire())
            case GiveUp(reason=reason):
                decision, new = self._coordinator.give_up(node, reason)
                if new:
                    self._warn_fallback()  # before the nodes hear it: they may finish the run quickly
                    self._server.broadcast(decision.to_wire())
                else:
                    self._server.send(node, decision.to_wire())
            case Bulk() as bulk:
                self._bulk(node, bulk)
            case Outcome(sealed=sealed):
                outcome = self._unseal(node, sealed)
                with self._lock:  # a node's end (with the ranks' last lines) completes a failure it sent at once
                    earlier = self.outcomes.get(node)
                    self.outcomes[node] = outcome if earlier is None else outcome.after(earlier)
                if self.on_outcome is not None:
                    self.on_outcome(node, outcome)
            case Report(report=report_data):
                if self.reports is None:
                    raise ValueError("a report, but this run has no report coordinator")
                self.reports.node_report(node, report_data)
            case Progress(stacks=stacks):
                if self.on_progress is not None:
                    self.on_progress(node, list(stacks))
            case Trace(rank=rank, data=data):
                if self.on_trace is not None:
                    self.on_trace(rank, bytes(data))
            case Dropped(count=count):
                self._receiver.dropped_lines(node, count)
            case Eof():
                with self._lock:
                    self._finished.add(node)
                    self._lock.notify_all()
            case unexpected:
                unreachable(unexpected)

    def _unseal(self, node: int, sealed: str) -> NodeOutcome:
        """A node's sealed end, opened as its task's rows are; raises MessageError."""
        try:
            sealed_node, outcome = unseal(sealed, self.spec.secret)
        except SealError as exc:
            raise MessageError(str(exc)) from None
        if sealed_node != node:
            raise MessageError(f"node {node} sent node {sealed_node}'s end")
        return outcome

    def _bulk(self, node: int, bulk: Bulk) -> None:
        """One piece of a node's bulk data to the sink; a failure is the node's to hear about."""
        with self._lock:
            failed = node in self._bulk_errors
        if failed:
            return  # the node was told the stream failed; the rest of its queued pieces go nowhere
        try:
            if self.bulk_sink is None:
                raise ValueError(f"node {node} sent bulk data this run does not expect")
            self.bulk_sink.piece(node, bulk.header, bulk.data)
        except Exception as exc:  # noqa: BLE001 - whatever it is, the node must not count it delivered
            error = f"{type(exc).__name__}: {exc}"
            with self._lock:
                self._bulk_errors[node] = error
            self._bulk_log(
                "spark_torch channel: the driver could not take node %s's data (%s); the node is told to send it "
                "another way",
                node,
                error,
            )
            self._server.send(node, BulkError(error).to_wire())  # before the ack of this piece

    def detached(self, node: int) -> None:
        """A node's connection ended (nothing to do: it reconnects, or the run ends)."""

    # run control
    def start_rendezvous_clock(self) -> None:
        """Give up on nodes that never reach the channel a while after their own deadline."""
        if self._nodes == 0:
            return
        self._expiry = threading.Timer(self.spec.rendezvous_timeout * 1.5 + GIVE_UP_SECONDS, self._expire)
        self._expiry.daemon = True
        self._expiry.start()

    def _expire(self) -> None:
        decision, new = self._coordinator.expire()
        if new:
            self._warn_fallback()
            self._server.broadcast(decision.to_wire())

    def _warn_fallback(self, errors: list[str] | None = None) -> bool:
        """The one fallback warning (address, missing nodes, errors known so far, the fix)."""
        with self._lock:
            if self._warned:
                return False
            self._warned = True
        known = errors or [f"node {n}: {e}" for n, e in sorted(self._coordinator.reports.items()) if e]
        missing = self._coordinator.missing()
        logger.warning(fallback_warning(self.spec.address, self._nodes, missing, self.spec.rendezvous_timeout, known))
        return True

    @property
    def fell_back(self) -> bool:
        """Whether the rendezvous went through Spark's allGather."""
        return self._warned

    def connect_errors(self, errors: dict[int, str]) -> None:
        """What nodes that never reached the channel saw (reported through Spark when the stage
        ends): the fallback warning if none was given yet, else the errors as its follow-up."""
        if not errors:
            return
        detail = [f"node {n}: {e}" for n, e in sorted(errors.items())]
        if not self._warn_fallback(detail):
            logger.warning(
                "spark_torch: the executors' last errors reaching the channel at %s: %s",
                self.spec.address,
                "; ".join(detail),
            )

    def answer_reports(self, step: int, error: str | None) -> None:
        """Tell every node that report step ``step`` is persisted (or failed)."""
        self._server.broadcast(Reported(step, error).to_wire())

    def request_traces(self, stopping: bool = False) -> None:
        """Ask every node for its ranks' Flight Recorder traces (a stall); with ``stopping``, the
        ranks are about to be stopped: the nodes may signal those that do not answer for their
        true stacks."""
        self._server.broadcast(Traces(stopping).to_wire())

    def stop_nodes(self, reason: StopReason) -> None:
        """Tell every node to stop its ranks now, and why (nodes that reconnect are told again)."""
        reason = StopReason(reason)  # a reason's value ("timeout") names it too
        with self._lock:
            self._stop_reason = reason
        self._server.broadcast(Stop(reason).to_wire())

    def node_outcomes(self) -> dict[int, NodeOutcome]:
        """How each node that said so ended its part, by node."""
        with self._lock:
            return dict(self.outcomes)

    def wait_for_nodes(self, timeout: float) -> bool:
        """Wait (bounded) until every node that ever attached sent its last line."""
        with self._lock:
            return self._lock.wait_for(lambda: self._attached <= self._finished, timeout)

    def close(self) -> None:
        """Stop listening, close every connection, join every thread of this channel."""
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry.join(1.0)
        self._server.close()
        self._bulk_log.flush("spark_torch channel: nodes whose data the driver could not take")
