"""Rank output over the channel: the node's line queue (an :class:`~spark_torch.transport.Outbox`)
and the driver's dispatch of received blocks to the log sink.

A node queues blocks of lines without ever blocking its pumps: beyond :data:`QUEUE_LINES` queued
lines new blocks are dropped and counted, and the count is reported to the driver. Queued
blocks are packed into messages of about :data:`FRAME_TEXT_BYTES` characters, split until each
fits a frame. Rank state changes (started/finished/failed) travel in the same order as the
lines, on a pseudo stream.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

from spark_torch.channel.wire import MAX_FRAME, FrameTooLarge, body_size, encode
from spark_torch.lines import RankOutput, block_lines

__all__ = ["LineQueue", "LineReceiver", "EVENT_STREAM", "QUEUE_LINES", "FRAME_TEXT_BYTES"]

#: pseudo stream of rank state changes (``started``/``finished``/``failed``) among the lines
EVENT_STREAM = "event"
#: lines queued before new ones are dropped (and counted); ~100 MB of 500-byte lines
QUEUE_LINES = 200_000
#: a message carries about this many characters of queued lines
FRAME_TEXT_BYTES = MAX_FRAME // 8
#: room left in a frame for the sequence number the transport adds
_SEQ_ROOM = 64



def _fits(message: dict[str, Any]) -> bool:
    try:
        return body_size(encode(message)) <= MAX_FRAME - _SEQ_ROOM
    except FrameTooLarge:
        return False


def _messages_of(entries: list[list[Any]]) -> list[dict[str, Any]]:
    """``entries`` as one ``lines`` message, or split until every part fits a frame."""
    message = {"lines": entries}
    if _fits(message):
        return [message]
    if len(entries) > 1:
        half = len(entries) // 2
        return _messages_of(entries[:half]) + _messages_of(entries[half:])
    rank, stream, block = entries[0]
    middle = block.rfind("\n", 0, len(block) // 2)
    if middle < 0:
        middle = block.find("\n", len(block) // 2)
    if middle < 0:  # cannot happen: a line is at most 64 Ki characters
        raise FrameTooLarge("a single log line does not fit a frame")
    return _messages_of([[rank, stream, block[:middle]]]) + _messages_of([[rank, stream, block[middle + 1 :]]])


class LineQueue:
    """Node side: queue of rank output for the driver; a line sink (callable) and an outbox.

    ``cond`` is the transport client's condition: queueing wakes its sender.
    """

    def __init__(self, node: int, cond: threading.Condition) -> None:
        self._node = node
        self.cond = cond
        #: (rank, stream, block, lines in it); None = end of stream
        self._queue: deque[tuple[int, str, str, int] | None] = deque()
        self._queued_lines = 0
        self._dropped = 0
        self._enabled = True

    def __call__(self, rank: int, stream: str, block: str) -> None:
        """Queue a block of lines; never blocks (drops and counts when the queue is full)."""
        count = block_lines(block)
        with self.cond:
            if not self._enabled:
                return
            if self._queued_lines + count > QUEUE_LINES:
                self._dropped += count
                return
            self._queued_lines += count
            self._queue.append((rank, stream, block, count))
            self.cond.notify_all()

    def rank_event(self, rank: int, state: str) -> None:
        """Queue a rank's state change for the driver's live status (never blocks)."""
        with self.cond:
            if self._enabled:
                self._queue.append((rank, EVENT_STREAM, state, 0))
                self.cond.notify_all()

    def end(self) -> None:
        """Queue the end-of-stream marker (after everything queued so far)."""
        with self.cond:
            self._queue.append(None)
            self.cond.notify_all()

    def disable(self) -> None:
        """Stop queueing (the driver is unreachable); what is queued is discarded."""
        with self.cond:
            self._enabled = False
            self._queue.clear()
            self._queued_lines = 0
            self._dropped = 0

    # Outbox (called with cond held)
    def pending(self) -> bool:
        """Whether there is anything to send."""
        return bool(self._queue) or self._dropped > 0

    def take(self) -> list[dict[str, Any]]:
        """Pack about FRAME_TEXT_BYTES of queued output into messages."""
        entries: list[list[Any]] = []
        messages: list[dict[str, Any]] = []
        eof = False
        size = 0
        if self._dropped:
            messages.append({"dropped": self._dropped})
            self._dropped = 0
        while self._queue and size < FRAME_TEXT_BYTES:
            item = self._queue.popleft()
            if item is None:
                eof = True
                break
            rank, stream, payload, count = item
            self._queued_lines -= count
            if stream != EVENT_STREAM:
                size += len(payload)
            entries.append([rank, stream, payload])
        if entries:
            messages += _messages_of(entries)
        if eof:
            messages.append({"eof": self._node})
        return messages


class LineReceiver:
    """Driver side: hands received blocks and rank events to the sink; counts drops."""

    def __init__(self, sink: RankOutput) -> None:
        self._sink = sink
        self._lock = threading.Lock()
        self.dropped = 0

    def lines(self, entries: Any) -> None:
        """A ``lines`` message: ``[[rank, stream, block], ...]``; raises ValueError if malformed."""
        if not isinstance(entries, list):
            raise ValueError("lines must be a list")
        checked: list[tuple[int, str, str]] = []
        for entry in entries:
            if not (isinstance(entry, list) and len(entry) == 3):
                raise ValueError("a lines entry must be [rank, stream, block]")
            rank, stream, block = entry
            if isinstance(rank, bool) or not isinstance(rank, int) or not isinstance(stream, str) or not isinstance(block, str):
                raise ValueError("a lines entry must be [int, str, str]")
            checked.append((rank, stream, block))
        for rank, stream, block in checked:
            if stream == EVENT_STREAM:
                self._sink.rank_event(rank, block)
            else:
                self._sink(rank, stream, block)
        self._sink.flush()

    def dropped_lines(self, node: int, count: Any) -> None:
        """A node dropped ``count`` lines (its queue was full): counted and shown."""
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError("dropped must be a non-negative int")
        with self._lock:
            self.dropped += count
        self._sink(-1, "stderr", f"[spark_torch] {count} log line(s) dropped on node {node}")
