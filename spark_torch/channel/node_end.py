"""A node's end of one run's channel: rank output out, the rendezvous, the driver's stop and
answers, the node's sealed end (its failures with it) and bulk data (rank 0's result)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from spark_torch.base.states import RankState, StopSignal
from spark_torch.channel.client import ChannelClient
from spark_torch.channel.log_stream import LineQueue
from spark_torch.channel.messages import (
    OUTCOME_ROOM,
    Bulk,
    BulkError,
    GiveUp,
    Hello,
    MessageError,
    Outcome,
    Rendezvous,
    Report,
    Reported,
    Stop,
    Trace,
    Traces,
    decode_driver_message,
    unreachable,
)
from spark_torch.channel.protocols import StepAnswers
from spark_torch.channel.rendezvous import GIVE_UP_SECONDS, RendezvousResult, result_of
from spark_torch.channel.transport import RateLimitedLog
from spark_torch.channel.wire import BINARY_HEADER_ROOM, MAX_FRAME
from spark_torch.shared.node_outcome import NodeOutcome
from spark_torch.shared.sealed import seal
from spark_torch.shared.spec import ChannelSpec

__all__ = ["NodeChannel"]

logger = logging.getLogger(__name__)


class NodeChannel:
    """A node's end: ships its ranks' output, takes part in the rendezvous, hears the driver's stop.

    Call it as a line sink (``channel(rank, stream, block)``); ``rank_event`` feeds the driver's
    live status. ``stop`` is set when the driver says stop (only here: the rendezvous waits on
    the client's condition for it); a :class:`~spark_torch.base.states.StopSignal` also keeps the
    driver's reason.
    """

    def __init__(
        self,
        spec: ChannelSpec,
        node: int,
        nodes: int,
        stop: threading.Event,
        *,
        reports: StepAnswers | None = None,
        on_trace_request: Callable[[bool], None] | None = None,
    ) -> None:
        """``reports``: where the driver's answers to report() steps go; ``on_trace_request``:
        called when the driver asks for the ranks' Flight Recorder traces (a stall), True when the
        ranks are about to be stopped (a signal for a stack can no longer change what they do)."""
        self._spec = spec
        self.reports = reports
        self.on_trace_request = on_trace_request
        self._node = node
        self._nodes = nodes
        self._stop = stop
        self._decided = threading.Event()
        self._decision: RendezvousResult | None = None
        self._detached = False
        self._closed = False
        #: the driver could not take this node's bulk data (its message); set under the client's cond
        self._bulk_error: str | None = None
        #: the driver's messages this node could not read (logged, rate-limited)
        self._refused = RateLimitedLog(logger, logging.WARNING)
        cond = threading.Condition()
        self._queue = LineQueue(node, cond)
        self._client = ChannelClient(
            spec.host,
            spec.port,
            spec.secret,
            node,
            self._on_message,
            outbox=self._queue,
            heartbeat=spec.heartbeat,
            cond=cond,
        )

    def __call__(self, rank: int, stream: str, block: str) -> None:
        self._queue(rank, stream, block)

    def rank_event(self, rank: int, state: RankState) -> None:
        """A rank started/finished/failed."""
        self._queue.rank_event(rank, state)

    def flush(self) -> None:
        """Nothing to do: queueing a block already woke the sender."""

    @property
    def connections(self) -> int:
        """How many times this node connected to the driver (1 unless a connection dropped)."""
        return self._client.connects

    def wait_attached(self, timeout: float) -> bool:
        """Wait until the driver accepted this node; False after ``timeout`` seconds."""
        return self._client.attached.wait(timeout)

    @property
    def connected_ever(self) -> bool:
        """Whether the driver ever accepted this node."""
        return self._client.attached.is_set()

    @property
    def last_error(self) -> str | None:
        """The latest connection error, for messages."""
        return self._client.last_error

    def forward_report(self, report: dict[str, Any]) -> None:
        """Send this node's report of one step to the driver (answered through ``reports``).
        Raises ``ValueError`` (or :class:`~spark_torch.channel.wire.FrameTooLarge`) for a
        report the channel cannot carry; nothing else queued is affected."""
        if self._detached:
            if self.reports is not None:
                self.reports.persisted(
                    int(report.get("step", 0)),
                    f"this node cannot reach the driver's channel at {self._spec.address}, which report() "
                    "needs (see the driver's warning about the channel)",
                )
            return
        self._client.send(Report(report).to_wire())

    def send_outcome(self, outcome: NodeOutcome, wait: float | None = None) -> None:
        """How this node's part ended (its group's state, each rank's, the failed ranks, the stop
        reason it acted on, the problem that kept it from starting its ranks), sealed as in its
        task's rows (within one frame: :func:`~spark_torch.shared.sealed.seal`'s ``limit``); sent
        before the channel closes, so the driver has it when the node's last line came. A rank's
        failure goes at once too (the driver then names the earliest, whichever task Spark saw
        failing first). ``wait``: seconds to wait for the driver to have it."""
        if self._detached or not self.connected_ever:
            return
        self._client.send(Outcome(seal(self._node, outcome, self._spec.secret, OUTCOME_ROOM)).to_wire())
        if wait is not None:
            self._client.drain(wait)

    def send_progress(self, stacks: list[dict[str, Any]]) -> None:
        """This node's ranks' progress and stacks (stall detection), for the driver."""
        if not self._detached:
            self._queue.progress(stacks)  # only the latest waits while the driver is unreachable

    def send_trace(self, rank: int, data: bytes) -> None:
        """A rank's Flight Recorder trace (raw bytes in one binary frame), for the driver."""
        if not self._detached:
            self._client.send(Trace(rank, data).to_wire())

    @property
    def usable(self) -> bool:
        """Whether the driver was reached and the channel is still in use."""
        return not self._detached and self.connected_ever

    @property
    def bulk_piece(self) -> int:
        """The largest piece of binary data one bulk message carries."""
        return MAX_FRAME - BINARY_HEADER_ROOM

    def send_bulk(self, header: dict[str, Any], data: memoryview, deadline: float) -> None:
        """Queue one piece of bulk data for the driver's bulk sink (encrypted binary frames;
        memory stays bounded: waits while a window of messages is unacknowledged). Raises
        ``TimeoutError`` at ``deadline`` (monotonic), ``ConnectionError`` when closing or when
        the driver said it could not take this node's bulk data (with the driver's reason)."""
        self._client.send(Bulk(header, data).to_wire(), block_until=deadline, abort=self._bulk_failure)

    def drain(self, timeout: float) -> bool:
        """Wait until the driver acknowledged everything sent; False on timeout, or when the
        driver could not take this node's bulk data."""
        return self._client.drain(timeout, abort=self._bulk_failure) and self._bulk_error is None

    def _bulk_failure(self) -> str | None:
        error = self._bulk_error
        return None if error is None else f"the driver could not take this node's data: {error}"

    def _on_message(self, message: dict[str, Any]) -> None:
        try:
            decoded = decode_driver_message(message)
        except MessageError as exc:  # ignored, as before: the driver's later messages still count
            self._refused("spark_torch channel: node %s ignored a message of the driver: %s", self._node, exc)
            return
        match decoded:
            case BulkError(error=error):
                with self._client.cond:  # wakes a send_bulk or drain waiting for the window
                    if self._bulk_error is None:
                        self._bulk_error = error
                    self._client.cond.notify_all()
            case Stop(reason=reason):
                with self._client.cond:  # wakes a rendezvous waiting for the decision
                    if isinstance(self._stop, StopSignal):
                        self._stop.request(reason)
                    else:
                        self._stop.set()
                    self._client.cond.notify_all()
            case Traces(stopping=stopping):
                if self.on_trace_request is not None:
                    self.on_trace_request(stopping)
            case Reported(step=step, error=error):
                if self.reports is not None:
                    self.reports.persisted(step, error)
            case Rendezvous() as decision:
                self._decided_by(decision)
            case unexpected:
                unreachable(unexpected)

    def _decided_by(self, decision: Rendezvous) -> None:
        """Take the driver's decision once (a reconnect replays the same one)."""
        if self._decided.is_set():
            return
        result = result_of(decision, self._nodes)
        if result is None:
            self._refused(
                "spark_torch channel: node %s ignored a rendezvous decision of %s nodes (this run has %s)",
                self._node,
                len(decision.peers or ()),
                self._nodes,
            )
            return
        with self._client.cond:
            self._decision = result
            self._decided.set()
            self._client.cond.notify_all()

    def _wait_decision(self, seconds: float) -> bool:
        """Whether the driver's decision came within ``seconds`` (False at once when told to stop)."""
        with self._client.cond:  # both are set under cond, with a notify (and only here)
            self._client.cond.wait_for(lambda: self._decided.is_set() or self._stop.is_set(), seconds)
            return self._decided.is_set()

    def rendezvous(self, hello: dict[str, Any]) -> RendezvousResult:
        """Say hello and wait for the driver's decision, bounded by the rendezvous deadline.

        Returns every node's hello (in node order), or a fallback result (then the caller goes
        through Spark's allGather), or ``stopped`` when the driver stopped the run meanwhile.
        """
        self._client.send(Hello(self._node, hello).to_wire())
        if not self._wait_decision(self._spec.rendezvous_timeout) and not self._stop.is_set():
            if self.connected_ever:  # ask the driver to decide; it may already have all hellos
                self._client.send(GiveUp(self.last_error).to_wire())
                self._wait_decision(GIVE_UP_SECONDS)
        if self._stop.is_set():
            return RendezvousResult(stopped=True)
        if self._decision is not None:
            return self._decision
        return RendezvousResult(
            reason=self.last_error or f"no answer from the driver's channel at {self._spec.address}"
        )

    def detach_if_unreachable(self) -> bool:
        """After a fallback: if the driver was never reached, stop trying (output goes elsewhere).

        Returns True when this node keeps using the channel.
        """
        if self.connected_ever:
            return True
        self._detached = True
        self._queue.disable()
        self._client.close()
        return False

    def close(self, timeout: float = 10.0) -> None:
        """Send what is queued and an end-of-stream marker until acknowledged (bounded), then close.

        A node whose attempts to reach the driver all failed so far gets a short grace only.
        Idempotent (a second call does not wait for a marker nobody sends).
        """
        if self._closed:
            return
        self._closed = True
        if not self._detached:
            self._queue.end()
            hopeless = not self.connected_ever and self.last_error is not None
            self._client.drain(min(timeout, 1.0) if hopeless else timeout)
        self._client.close()
