"""Rank output over the channel: the node's line queue (an :class:`~spark_torch.channel.client.Outbox`)
and the driver's dispatch of received blocks to the log sink.

A node queues blocks of lines without ever blocking its pumps: beyond :data:`QUEUE_LINES` queued
lines or :data:`QUEUE_BYTES` queued bytes (UTF-8) new blocks are dropped and counted, and the
count is reported to the driver. A block that UTF-8 cannot carry (a lone surrogate, e.g. from
``surrogateescape``) is repaired when queued (the surrogate shown as ``\\udcXX``). Queued blocks
are packed into messages of about :data:`FRAME_TEXT_BYTES` bytes, each encoded on its own and
split until it fits a frame, so one bad entry never takes a batch down: what still cannot be
sent is replaced by a line saying so. Rank state changes (started/finished/failed) travel in
the same order as the lines, on a pseudo stream. The node's progress snapshots (stall detection)
wait here too, only the latest one, split per rank when a frame cannot hold them all.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

from spark_torch.base.states import RankState
from spark_torch.channel.client import Frame, Numbering
from spark_torch.channel.messages import EVENT_STREAM, Dropped, Eof, Lines, Progress
from spark_torch.channel.wire import MAX_FRAME, FrameTooLarge, sendable
from spark_torch.shared.lines import RankOutput, block_lines

__all__ = ["LineQueue", "LineReceiver", "QUEUE_LINES", "QUEUE_BYTES", "FRAME_TEXT_BYTES"]
#: lines queued before new ones are dropped (and counted)
QUEUE_LINES = 200_000
#: bytes (UTF-8) of lines queued before new ones are dropped (and counted): lines of up to 64 KiB
#: would otherwise let QUEUE_LINES hold ~12 GiB
QUEUE_BYTES = 64 * 1024 * 1024
#: a message carries about this many bytes of queued lines
FRAME_TEXT_BYTES = MAX_FRAME // 8


def _frames_of(entries: tuple[tuple[int, str, str], ...], number: Numbering) -> list[Frame]:
    """``entries`` as one numbered ``lines`` frame, or split until every part fits a frame; an
    entry that still cannot be encoded becomes a line that says so (never a silent loss)."""
    try:
        return [number(Lines(entries).to_wire())]
    except (ValueError, TypeError) as exc:  # FrameTooLarge is a ValueError too
        problem = exc
    if len(entries) > 1:
        half = len(entries) // 2
        return _frames_of(entries[:half], number) + _frames_of(entries[half:], number)
    rank, stream, block = entries[0]
    middle = block.rfind("\n", 0, len(block) // 2)
    if middle < 0:
        middle = block.find("\n", len(block) // 2)
    if isinstance(problem, FrameTooLarge) and middle >= 0:
        return _frames_of(((rank, stream, block[:middle]),), number) + _frames_of(
            ((rank, stream, block[middle + 1 :]),), number
        )
    note = (
        f"[spark_torch] {block_lines(block)} line(s) of rank {rank} could not be sent: "
        f"{type(problem).__name__}: {problem}"
    )
    return [number(Lines(((-1, "stderr", note[:1000]),)).to_wire())]


def _progress_frames(stacks: tuple[Any, ...], number: Numbering) -> list[Frame]:
    """A node's snapshot as one numbered ``progress`` frame, or split per rank until each part
    fits; a rank whose stack alone is too large keeps its innermost calls (the end of its text),
    so the driver never misses a rank (a missing one would read as a rank that never started)."""
    try:
        return [number(Progress(stacks).to_wire())]
    except (ValueError, TypeError) as exc:  # FrameTooLarge is a ValueError too
        problem = exc
    if len(stacks) > 1:
        half = len(stacks) // 2
        return _progress_frames(stacks[:half], number) + _progress_frames(stacks[half:], number)
    stack = stacks[0] if stacks else None
    if not isinstance(stack, dict) or not isinstance(problem, FrameTooLarge) or not isinstance(stack.get("text"), str):
        return []  # nothing that cutting can fix (the node's own snapshot: cannot happen)
    text: str = stack["text"]
    keep = len(text) // 2
    return _progress_frames(({**stack, "text": ("...\n" + text[len(text) - keep :]) if keep else ""},), number)


class LineQueue:
    """Node side: queue of rank output for the driver; a line sink (callable) and an outbox.

    ``cond`` is the transport client's condition: queueing wakes its sender.
    """

    def __init__(self, node: int, cond: threading.Condition) -> None:
        self._node = node
        self.cond = cond
        #: (rank, stream, block, lines in it, its UTF-8 bytes); None = end of stream
        self._queue: deque[tuple[int, str, str, int, int] | None] = deque()
        self._queued_lines = 0
        self._queued_bytes = 0
        self._dropped = 0
        self._enabled = True
        #: the node's latest progress snapshot not sent yet (only the latest: a newer one replaces it)
        self._progress: list[Any] | None = None

    def __call__(self, rank: int, stream: str, block: str) -> None:
        """Queue a block of lines; never blocks (drops and counts when the queue is full)."""
        count = block_lines(block)
        block, size = sendable(block)
        with self.cond:
            if not self._enabled:
                return
            if self._queued_lines + count > QUEUE_LINES or self._queued_bytes + size > QUEUE_BYTES:
                self._dropped += count
                return
            self._queued_lines += count
            self._queued_bytes += size
            self._queue.append((rank, stream, block, count, size))
            self.cond.notify_all()

    def rank_event(self, rank: int, state: RankState) -> None:
        """Queue a rank's state change for the driver's live status (never blocks)."""
        with self.cond:
            if self._enabled:
                self._queue.append((rank, EVENT_STREAM, sendable(state)[0], 0, 0))
                self.cond.notify_all()

    def progress(self, stacks: list[Any]) -> None:
        """Queue the node's progress snapshot in place of one not sent yet (never blocks; while
        the driver is unreachable only the latest waits)."""
        with self.cond:
            if self._enabled:
                self._progress = stacks
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
            self._queued_bytes = 0
            self._dropped = 0
            self._progress = None

    # Outbox (called with cond held)
    def pending(self) -> bool:
        """Whether there is anything to send."""
        return bool(self._queue) or self._dropped > 0 or self._progress is not None

    def take(self, number: Numbering) -> list[Frame]:
        """Pack about FRAME_TEXT_BYTES of queued output into numbered frames."""
        entries: list[tuple[int, str, str]] = []
        frames: list[Frame] = []
        eof = False
        size = 0
        if self._dropped:
            frames.append(number(Dropped(self._dropped).to_wire()))
            self._dropped = 0
        if self._progress is not None:
            frames += _progress_frames(tuple(self._progress), number)
            self._progress = None
        while self._queue and size < FRAME_TEXT_BYTES:
            item = self._queue.popleft()
            if item is None:
                eof = True
                break
            rank, stream, payload, count, nbytes = item
            self._queued_lines -= count
            self._queued_bytes -= nbytes
            size += nbytes
            entries.append((rank, stream, payload))
        if entries:
            frames += _frames_of(tuple(entries), number)
        if eof:
            frames.append(number(Eof(self._node).to_wire()))
        return frames


class LineReceiver:
    """Driver side: hands received blocks and rank events to the sink; counts drops."""

    def __init__(self, sink: RankOutput) -> None:
        self._sink = sink
        self._lock = threading.Lock()
        self.dropped = 0

    def lines(self, message: Lines) -> None:
        """A ``lines`` message (checked when decoded); an unknown rank state raised there."""
        for rank, stream, block in message.entries:
            if stream == EVENT_STREAM:
                self._sink.rank_event(rank, RankState(block))
            else:
                self._sink(rank, stream, block)
        self._sink.flush()

    def dropped_lines(self, node: int, count: int) -> None:
        """A node dropped ``count`` lines (its queue was full): counted and shown."""
        with self._lock:
            self.dropped += count
        self._sink(-1, "stderr", f"[spark_torch] {count} log line(s) dropped on node {node}")
