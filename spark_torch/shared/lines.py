"""Blocks of log lines (complete lines of one rank's stream joined by "\\n") and where they go.

A block is what a pump hands over per pipe read and what a log frame carries. Handling a block
with str methods (``replace``, ``rsplit``, ``count``) costs next to nothing per line, unlike a
Python loop over lines. :class:`RankOutput` is what every receiver of rank output is (the
driver's printer, a node's channel, an executor's log).
"""

from __future__ import annotations

from typing import Protocol

from spark_torch.base.states import RankState

__all__ = ["MAX_LINE_BYTES", "CONTINUED", "split_lines", "make_block", "block_lines", "last_lines", "RankOutput"]


class RankOutput(Protocol):
    """Receives the ranks' output and state changes (from pump threads: thread-safe)."""

    def __call__(self, rank: int, stream: str, block: str) -> None:
        """A block of complete lines of ``rank``'s ``stream`` ("stdout"/"stderr"); rank -1: spark_torch's own."""

    def flush(self) -> None:
        """A batch ended (one pipe read, one frame): make what was written visible."""

    def rank_event(self, rank: int, state: RankState) -> None:
        """A rank started, finished, failed or was stopped by spark_torch."""


#: longer lines are split into pieces of this many characters, each marked as continued
MAX_LINE_BYTES = 64 * 1024
CONTINUED = " [line continues]"


def _without_carriage_returns(text: str) -> str:
    """``text`` with "\\r\\n" made "\\n", including the last line's (whose "\\n" was cut off)."""
    if text.endswith("\r"):
        text = text[:-1]
    return text.replace("\r\n", "\n") if "\r" in text else text


def split_lines(text: str) -> list[str]:
    """Complete lines of ``text`` (no trailing newline), each at most MAX_LINE_BYTES characters."""
    text = _without_carriage_returns(text)
    lines = text.split("\n")
    if len(text) <= MAX_LINE_BYTES or max(map(len, lines)) <= MAX_LINE_BYTES:
        return lines
    out: list[str] = []
    for line in lines:
        while len(line) > MAX_LINE_BYTES:
            out.append(line[:MAX_LINE_BYTES] + CONTINUED)
            line = line[MAX_LINE_BYTES:]
        out.append(line)
    return out


def make_block(text: str) -> str:
    """``text`` (complete lines, no trailing newline) as a block: "\\r\\n" made "\\n", lines
    longer than MAX_LINE_BYTES characters split and marked as continued."""
    if len(text) > MAX_LINE_BYTES:
        return "\n".join(split_lines(text))
    return _without_carriage_returns(text)


def block_lines(block: str) -> int:
    """How many lines a block holds."""
    return block.count("\n") + 1


def last_lines(block: str, count: int) -> list[str]:
    """The last ``count`` lines of a block."""
    return block.rsplit("\n", count)[-count:]
