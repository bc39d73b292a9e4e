"""Where the ranks are: one rank's stack as the driver knows it, and the grouped text a stall
warning, a :class:`~spark_torch.RunStalledError` or a :class:`~spark_torch.RunTimeoutError`
shows (ranks with the same stack together: "ranks 0, 2-7", "rank 1").

Shared by the three sides: a rank counts its report() calls here (:func:`note_progress`) and
marks its upload (:func:`working`), a node
sends :class:`RankStack` fields in its progress messages, the driver groups them. Plain data only.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from spark_torch.base.states import ValueEnum

__all__ = [
    "StackState",
    "RankStack",
    "note_progress",
    "progress_count",
    "working",
    "is_working",
    "rank_ranges",
    "format_stacks",
    "innermost_call",
    "strip_source_lines",
    "cut_tail",
    "cut_head",
    "report_deadlock",
    "MAX_TRACE_BYTES",
    "DUMP_SIGNAL_OFFSET",
]

#: a rank's Flight Recorder trace larger than this is not collected (it travels in one frame)
MAX_TRACE_BYTES = 512 * 1024


#: a rank's faulthandler dumps its stacks on ``SIGRTMIN`` + this (a real-time signal no
#: framework we know of claims: torch elastic uses SIGTERM/SIGUSR, Spark and Python none of them)
DUMP_SIGNAL_OFFSET = 6

#: report() calls of this process (a rank): progress even when the stack looks the same
_progress = 0


def note_progress() -> None:
    """A rank did something that counts as progress (report())."""
    global _progress
    _progress += 1


def progress_count() -> int:
    """How many times :func:`note_progress` was called in this process."""
    return _progress


#: spark_torch's own work in progress in this process (report()'s upload)
_working = 0


@contextlib.contextmanager
def working() -> Iterator[None]:
    """spark_torch's own work in a rank (report()'s checkpoint upload): the rank makes progress
    while it lasts, however long it waits (on the network, on fsspec's IO thread)."""
    global _working
    _working += 1
    try:
        yield
    finally:
        _working -= 1


def is_working() -> bool:
    """A :func:`working` block runs in this process."""
    return _working > 0


class StackState(ValueEnum):
    """What is known about a rank's position."""

    #: sampled: ``text`` is where its main thread is
    SAMPLED = "sampled"
    #: started, not sampled yet (importing, unpickling the function)
    STARTING = "starting"
    #: its sampler stopped answering (a native call holding the GIL?): ``text`` is the last stack
    NOT_ANSWERING = "not answering"
    #: its process exited
    EXITED = "exited"
    #: its process is stopped (SIGSTOP, a debugger: state T): ``text`` is the last stack
    STOPPED = "stopped"


@dataclass(frozen=True)
class RankStack:
    """One rank's latest stack (innermost call last) and how long it made no progress."""

    rank: int
    text: str
    #: seconds since the rank last made progress
    idle: float
    state: StackState = StackState.SAMPLED
    #: seconds since ``text`` was sampled
    age: float = 0.0
    #: the rank's last output lines (what it said before it stopped moving)
    output: str = ""

    def to_dict(self) -> dict[str, object]:
        """A JSON-ready dict (what a node sends)."""
        return {
            "rank": self.rank,
            "text": self.text,
            "idle": self.idle,
            "state": self.state.value,
            "age": self.age,
            "output": self.output,
        }

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> RankStack:
        """Inverse of :meth:`to_dict` (values from a node: checked, text bounded)."""
        state = str(data.get("state", StackState.SAMPLED.value))
        return cls(
            rank=int(str(data["rank"])),
            text=cut_head(str(data.get("text", "")), MAX_STACK_CHARS),
            idle=max(0.0, float(str(data.get("idle", 0.0)))),
            state=StackState(state) if state in StackState._value2member_map_ else StackState.SAMPLED,
            age=max(0.0, float(str(data.get("age", 0.0)))),
            output=str(data.get("output", ""))[:MAX_OUTPUT_CHARS],
        )


#: a stack longer than this is cut (its innermost end kept)
MAX_STACK_CHARS = 16_000
#: the last output lines that go with a rank's stack, at most this long
MAX_OUTPUT_CHARS = 1_000


def rank_ranges(ranks: Iterable[int]) -> str:
    """``[0, 2, 3, 4, 7]`` -> ``"0, 2-4, 7"``."""
    ordered = sorted(set(ranks))
    parts: list[str] = []
    start = prev = None
    for rank in ordered:
        if start is None:
            start = prev = rank
        elif prev is not None and rank == prev + 1:
            prev = rank
        else:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
            start = prev = rank
    if start is not None:
        parts.append(str(start) if start == prev else f"{start}-{prev}")
    return ", ".join(parts)


_STDLIB = re.compile(r"[/\\]lib[/\\]python3\.\d+[/\\](?!site-packages|dist-packages)|^<frozen ")
_LIBRARY = re.compile(r"[/\\](site-packages|dist-packages)[/\\]")
_PACKAGE = re.compile(r"[/\\]spark_torch[/\\]")
_FRAME = re.compile(r'^File "(?P<file>.*)", line \d+, in (?P<name>.+)$')


def _main_frames(text: str) -> list[tuple[str, str]]:
    """(filename, function) of a stack text's main thread, innermost last."""
    frames = []
    for line in text.splitlines():
        if line.startswith("  Thread ") or line.startswith("  Process "):
            break  # the other threads and processes shown with it
        match = _FRAME.match(line.strip())
        if match:
            frames.append((match["file"], match["name"]))
    return frames


def innermost_call(text: str) -> str:
    """What a stack's header names: the innermost frame outside Python's standard library
    (``"all_reduce"``, ``"load_batch"``), spark_torch's own as ``spark_torch.report()``, a
    library's with the user's frame that called it (``"_try_get_data, from train"``); ``""``
    when there is no frame."""
    frames = _main_frames(text)
    if not frames:
        return ""
    outside = [f for f in frames if not _STDLIB.search(f[0])]
    if not outside:
        return frames[-1][1]
    filename, name = outside[-1]
    if _PACKAGE.search(filename):
        return f"spark_torch.{name}()"
    if _LIBRARY.search(filename):
        users = [f for f in outside if not _LIBRARY.search(f[0]) and not _PACKAGE.search(f[0])]
        if users:
            return f"{name}, from {users[-1][1]}"
    return name


#: a torch.distributed call (a collective, a point-to-point wait, a barrier)
_DISTRIBUTED = re.compile(r"[/\\]torch[/\\]distributed[/\\]")


def _waits_in_report(text: str) -> bool:
    return any(_PACKAGE.search(file) and name == "report" for file, name in _main_frames(text))


def _waits_in_distributed(text: str) -> bool:
    outside = [file for file, _ in _main_frames(text) if not _STDLIB.search(file)]
    return bool(outside) and bool(_DISTRIBUTED.search(outside[-1]))


def report_deadlock(stacks: Sequence[RankStack], after: float) -> tuple[list[int], list[RankStack]] | None:
    """``(ranks in report(), the other ranks)`` when some ranks wait in :func:`spark_torch.report`
    while every other running rank has waited at least ``after`` seconds inside a
    torch.distributed call: they cannot reach report() until a collective completes, and the
    ranks in report() cannot join it until they do (report() under ``if rank == 0:``). None
    otherwise, and whenever a rank's position is not known for sure."""
    live = [s for s in stacks if s.state is not StackState.EXITED]
    if not live or any(s.state is not StackState.SAMPLED or s.idle < after for s in live):
        return None
    in_report = [s.rank for s in live if _waits_in_report(s.text)]
    elsewhere = [s for s in live if s.rank not in in_report]
    if not in_report or not elsewhere or not all(_waits_in_distributed(s.text) for s in elsewhere):
        return None
    return in_report, elsewhere


def strip_source_lines(text: str) -> str:
    """A stack text without its source lines (``stall_source_lines=False``): file, line and
    function only."""
    return "".join(
        line
        for line in text.splitlines(keepends=True)
        if not line.startswith("    ") or line.strip().startswith("File ")
    )


def _chunks(text: str) -> list[str]:
    """A stack text in pieces that are never cut: a frame with its source line, a header line."""
    chunks: list[str] = []
    for line in text.splitlines(keepends=True):
        if chunks and line.startswith("    ") and not line.strip().startswith("File "):
            chunks[-1] += line  # a source line stays with its frame
        else:
            chunks.append(line)
    return chunks


def cut_tail(text: str, limit: int) -> str:
    """``text`` within ``limit`` characters, its innermost frames kept whole: outer frames are
    dropped (a line ``  ...`` in their place), never cut inside a line."""
    if len(text) <= limit:
        return text
    kept: list[str] = []
    size = len("  ...\n")
    for chunk in reversed(_chunks(text)):
        if size + len(chunk) > limit:
            break
        kept.append(chunk)
        size += len(chunk)
    return "  ...\n" + "".join(reversed(kept))


def cut_head(text: str, limit: int) -> str:
    """``text`` within ``limit`` characters, its first pieces kept whole (never cut inside a line)."""
    if len(text) <= limit:
        return text
    kept, size = [], 0
    for chunk in _chunks(text):
        if size + len(chunk) > limit:
            break
        kept.append(chunk)
        size += len(chunk)
    return "".join(kept)


def _label(state: StackState, age: float, text: str = "") -> str:
    if state is StackState.STARTING:
        return " (starting: not sampled yet)"
    if state is StackState.EXITED:
        return " (exited)"
    if state is StackState.STOPPED:
        return " (its process is stopped: SIGSTOP or a debugger; its last stack)"
    if state is StackState.NOT_ANSWERING and not text.strip():
        return f" (has not answered since it started {age:.0f}s ago: a native call may hold the GIL)"
    if state is StackState.NOT_ANSWERING:
        return (
            f" (not answering for {age:.0f}s: a native call holds the GIL; its last sampled stack, or "
            "faulthandler's when the run is being stopped)"
        )
    return ""


def _output(members: Sequence[RankStack]) -> str:
    blocks = []
    for stack in members:
        if stack.output.strip():
            lines = "".join(f"    {line}\n" for line in stack.output.rstrip().splitlines())
            blocks.append(f"  rank {stack.rank}'s last output:\n{lines}")
    return "".join(blocks)


def format_stacks(stacks: Sequence[RankStack]) -> str:
    """Every rank's stack, ranks with the same stack and state grouped, the largest group first,
    each with its ranks' last output lines:

    .. code-block:: text

        ranks 0, 2-7: in all_reduce, from train
          File "train.py", line 12, in train
            dist.all_reduce(t)
          ...
        rank 1: in load_batch
          ...
    """
    groups: dict[tuple[str, StackState], list[RankStack]] = {}
    for stack in stacks:
        groups.setdefault((stack.text, stack.state), []).append(stack)
    ordered = sorted(groups.items(), key=lambda item: (-len(item[1]), min(s.rank for s in item[1])))
    blocks = []
    for (text, state), members in ordered:
        ranks = [s.rank for s in members]
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {rank_ranges(ranks)}"
        call = innermost_call(text)
        head = f"{who}: in {call}" if call else who
        body = text.rstrip() or "  (no Python frame)"
        blocks.append(
            f"{head}{_label(state, max(s.age for s in members), text)}\n{body}\n{_output(members)}".rstrip("\n")
        )
    return "\n".join(blocks)
