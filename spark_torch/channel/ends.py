"""The per-run channel between the driver and the node runners, assembled from its layers.

- :mod:`spark_torch.channel.wire`: framing and mutual authentication (per-frame HMAC);
- :mod:`spark_torch.channel.transport`: reconnects, acknowledgements, heartbeats, bounds;
- :mod:`spark_torch.channel.log_stream`: rank output (node queue, driver dispatch);
- :mod:`spark_torch.channel.rendezvous`: the rendezvous decision, and the driver's stop.

:class:`DriverChannel` is the driver's end of one run, :class:`NodeChannel` a node's end.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from typing import Any

from spark_torch.channel.log_stream import LineQueue, LineReceiver, LinesHandler
from spark_torch.channel.rendezvous import RendezvousCoordinator, RendezvousOutcome, fallback_warning, parse_decision
from spark_torch.channel.transport import ChannelClient, ChannelServer
from spark_torch.channel.wire import BINARY_HEADER_ROOM, MAX_FRAME
from spark_torch.failure_reports import FailureReport, merge_reports, report_from_dict, report_to_dict
from spark_torch.reporting.coordinator import ReportCoordinator
from spark_torch.reporting.pipes import NodeReports
from spark_torch.spec import ChannelSpec

__all__ = ["DriverChannel", "NodeChannel", "new_secret"]

logger = logging.getLogger(__name__)

#: after its deadline, how long a connected node waits for the driver's answer to "give up"
GIVE_UP_SECONDS = 5.0


def new_secret() -> bytes:
    """A fresh per-run key."""
    return os.urandom(32)


class DriverChannel:
    """The driver's end of one run: receives rank output, runs the rendezvous, stops nodes.

    Listens on ``bind_host`` (a port of ``ports``, or one the OS picks); nodes are told
    ``advertise_host`` (and ``advertise_port``, default the bound port) through :attr:`spec`.
    """

    def __init__(
        self,
        sink: LinesHandler,
        *,
        nodes: int,
        bind_host: str,
        advertise_host: str,
        secret: bytes,
        advertise_port: int | None = None,
        ports: tuple[int, int] | None = None,
        heartbeat: float = 2.0,
        rendezvous_timeout: float = 60.0,
    ) -> None:
        self._nodes = nodes
        #: report() of the ranks (set by the caller: it needs this channel to answer)
        self.reports: ReportCoordinator | None = None
        #: failure reports the nodes sent over the channel (authenticated), by node
        self.failures: dict[int, FailureReport] = {}
        #: where rank 0's result goes when node 0 streams it over the channel (set by the caller)
        self.result_path: str | None = None
        self._result_fd: int | None = None
        self._result_received = 0
        self._receiver = LineReceiver(sink)
        self._coordinator = RendezvousCoordinator(nodes)
        self._lock = threading.Condition()
        self._stop_reason: str | None = None
        self._attached: set[int] = set()
        self._finished: set[int] = set()
        self._warned = False
        self._server = ChannelServer(bind_host, secret, self, nodes=nodes, ports=ports, heartbeat=heartbeat)
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
        replay: list[dict[str, Any]] = []
        if self._coordinator.decision is not None:
            replay.append({"rendezvous": self._coordinator.decision})
        if stop is not None:
            replay.append({"stop": stop})
        if self.reports is not None and self.reports.last_answer is not None:
            step, error = self.reports.last_answer
            replay.append({"reported": {"step": step, "error": error}})
        return replay

    def message(self, node: int, message: dict[str, Any]) -> None:
        """One numbered message of a node, exactly once."""
        if "lines" in message:
            self._receiver.lines(message["lines"])
        elif "hello" in message:
            decision = self._coordinator.hello(node, message["hello"])
            if decision is not None:
                self._server.broadcast({"rendezvous": decision})
        elif "give_up" in message:
            decision, new = self._coordinator.give_up(node, message["give_up"])
            if new:
                self._warn_fallback()  # before the nodes hear it: they may finish the run quickly
                self._server.broadcast({"rendezvous": decision})
            else:
                self._server.send(node, {"rendezvous": decision})
        elif "result" in message:
            self._result_piece(node, message["result"], message.get("_bytes"))
        elif "failure" in message:
            report = report_from_dict(message["failure"])
            with self._lock:  # a node's later report (with the ranks' last lines) completes its first
                earlier = self.failures.get(node)
                self.failures[node] = report if earlier is None else merge_reports([report, earlier]) or report
        elif "report" in message:
            if self.reports is None:
                raise ValueError("a report, but this run has no report coordinator")
            self.reports.node_report(node, message["report"])
        elif "dropped" in message:
            self._receiver.dropped_lines(node, message["dropped"])
        elif "eof" in message:
            with self._lock:
                self._finished.add(node)
                self._lock.notify_all()
        else:
            raise ValueError(f"unknown message {sorted(message)[:5]}")

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
            self._server.broadcast({"rendezvous": decision})

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
            logger.warning("spark_torch: the executors' last errors reaching the channel at %s: %s", self.spec.address, "; ".join(detail))

    def _result_piece(self, node: int, header: Any, data: Any) -> None:
        """A piece of rank 0's pickled result (authenticated frames, in order, exactly once)."""
        if node != 0 or self.result_path is None:
            raise ValueError(f"node {node} sent a result piece this run does not expect")
        if not isinstance(header, dict) or not isinstance(data, (bytes, bytearray, memoryview)):
            raise ValueError("a result piece needs a header object and binary data")
        offset = header.get("offset")
        if isinstance(offset, bool) or not isinstance(offset, int) or offset != self._result_received:
            raise ValueError(f"a result piece at offset {offset!r}, expected {self._result_received}")
        if self._result_fd is None:
            self._result_fd = os.open(self.result_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        view = memoryview(data)
        while view:
            written = os.pwrite(self._result_fd, view, offset)
            view, offset = view[written:], offset + written
        self._result_received = offset

    def result_size(self) -> int:
        """Bytes of rank 0's result received over the channel (the file is closed once asked)."""
        if self._result_fd is not None:
            os.close(self._result_fd)
            self._result_fd = None
        return self._result_received

    def answer_reports(self, step: int, error: str | None) -> None:
        """Tell every node that report step ``step`` is persisted (or failed)."""
        self._server.broadcast({"reported": {"step": step, "error": error}})

    def stop_nodes(self, reason: str) -> None:
        """Tell every node to stop its ranks now (nodes that reconnect are told again)."""
        with self._lock:
            self._stop_reason = reason
        self._server.broadcast({"stop": reason})

    def wait_for_nodes(self, timeout: float) -> bool:
        """Wait (bounded) until every node that ever attached sent its last line."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while not self._attached <= self._finished:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._lock.wait(remaining)
        return True

    def close(self) -> None:
        """Stop listening, close every connection, join every thread of this channel."""
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry.join(1.0)
        self._server.close()
        if self._result_fd is not None:
            os.close(self._result_fd)
            self._result_fd = None


class NodeChannel:
    """A node's end: ships its ranks' output, takes part in the rendezvous, hears the driver's stop.

    Call it as a line sink (``channel(rank, stream, block)``); ``rank_event`` feeds the driver's
    live status. ``stop`` is set when the driver says stop.
    """

    def __init__(self, spec: ChannelSpec, node: int, nodes: int, stop: threading.Event) -> None:
        self._spec = spec
        #: the node's report pipes (set by the node runner): answers from the driver go there
        self.reports: NodeReports | None = None
        self._node = node
        self._nodes = nodes
        self._stop = stop
        self._decided = threading.Event()
        self._outcome: RendezvousOutcome | None = None
        self._detached = False
        cond = threading.Condition()
        self._queue = LineQueue(node, cond)
        self._client = ChannelClient(
            spec.host, spec.port, spec.secret, node, self._on_message, outbox=self._queue, heartbeat=spec.heartbeat, cond=cond
        )

    def __call__(self, rank: int, stream: str, block: str) -> None:
        self._queue(rank, stream, block)

    def rank_event(self, rank: int, state: str) -> None:
        """A rank started/finished/failed."""
        self._queue.rank_event(rank, state)

    @property
    def connected_ever(self) -> bool:
        """Whether the driver ever accepted this node."""
        return self._client.attached.is_set()

    @property
    def last_error(self) -> str | None:
        """The latest connection error, for messages."""
        return self._client.last_error

    def forward_report(self, report: dict[str, Any]) -> None:
        """Send this node's report of one step to the driver (answered through ``reports``)."""
        if self._detached:
            if self.reports is not None:
                self.reports.persisted(
                    int(report.get("step", 0)),
                    f"this node cannot reach the driver's channel at {self._spec.address}, which report() "
                    "needs (see the driver's warning about the channel)",
                )
            return
        self._client.send({"report": report})

    def send_failure(self, report: FailureReport, timeout: float | None = 2.0) -> None:
        """Tell the driver about this node's failed ranks (authenticated); waits up to ``timeout``
        for the driver to have it (None: do not wait)."""
        if self._detached or not self.connected_ever:
            return
        self._client.send({"failure": report_to_dict(report)})
        if timeout is not None:
            self._client.drain(timeout)

    def send_result(self, path: str, timeout: float) -> bool:
        """Stream the file of rank 0's pickled result to the driver in authenticated binary frames;
        True once the driver acknowledged all of it (False: not connected, or no progress for
        ``timeout`` seconds: the caller sends it through Spark instead)."""
        if self._detached or not self.connected_ever:
            return False
        piece = MAX_FRAME - BINARY_HEADER_ROOM
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            # pieces are views of a memory map: the page cache goes to the socket without copies
            mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) if size else None
        # the map is unmapped when the last view of it is gone (pieces the client still holds
        # for a resend keep it alive; closing it here could pull pages from under them)
        view = memoryview(mapped) if mapped is not None else memoryview(b"")
        try:
            offset = 0
            while True:
                data = view[offset : offset + piece]
                self._client.send({"result": {"offset": offset}, "_bytes": data}, block_until=time.monotonic() + timeout)
                offset += data.nbytes
                if offset >= size:
                    break
            return self._client.drain(timeout)
        except (TimeoutError, ConnectionError):
            return False

    def _on_message(self, message: dict[str, Any]) -> None:
        if "stop" in message:
            self._stop.set()
        elif "reported" in message:
            answer = message["reported"]
            if self.reports is not None and isinstance(answer, dict) and isinstance(answer.get("step"), int):
                error = answer.get("error")
                self.reports.persisted(answer["step"], str(error) if error else None)
        elif "rendezvous" in message and not self._decided.is_set():
            outcome = parse_decision(message["rendezvous"], self._nodes)
            if outcome is not None:
                self._outcome = outcome
                self._decided.set()

    def _wait_decision(self, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while not self._decided.is_set():
            if self._stop.is_set():
                return False
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self._decided.wait(min(remaining, 0.1))
        return True

    def rendezvous(self, hello: dict[str, Any]) -> RendezvousOutcome:
        """Say hello and wait for the driver's decision, bounded by the rendezvous deadline.

        Returns every node's hello (in node order), or a fallback outcome (then the caller goes
        through Spark's allGather), or ``stopped`` when the driver stopped the run meanwhile.
        """
        self._client.send({"hello": {**hello, "node": self._node}})
        if not self._wait_decision(self._spec.rendezvous_timeout) and not self._stop.is_set():
            if self.connected_ever:  # ask the driver to decide; it may already have all hellos
                self._client.send({"give_up": self.last_error})
                self._wait_decision(GIVE_UP_SECONDS)
        if self._stop.is_set():
            return RendezvousOutcome(stopped=True)
        if self._outcome is not None:
            return self._outcome
        return RendezvousOutcome(reason=self.last_error or f"no answer from the driver's channel at {self._spec.address}")

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
        """
        if not self._detached:
            self._queue.end()
            hopeless = not self.connected_ever and self.last_error is not None
            self._client.drain(min(timeout, 1.0) if hopeless else timeout)
        self._client.close()
