"""A node's progress watch: how long each of its ranks made no progress, and where it is.

Every ``interval`` seconds it reads each rank's stack file (written by
:mod:`spark_torch.rank.sampler`) and sends one snapshot (a list of
:class:`~spark_torch.shared.stacks.RankStack` dicts) to the driver, which decides whether the run is
stalled. A rank makes progress when its sampler says so (:mod:`spark_torch.rank.progress_signals`:
its main thread computed, read or wrote, reported, or reached a new position) or when it exits.
Its output counts only while it is not sampled: a sampled rank's output is counted by the
sampler when its main thread writes it (a heartbeat thread printing beside a hung main thread
is no progress). A rank whose sampler stops answering is looked at from outside: a stopped
process (state T) is marked stopped; otherwise it is in a native call holding the GIL: its main
thread's CPU time still counts as computing, and only when the driver stops the ranks
(``stall_action="fail"``) is faulthandler asked for its true stack (a signal: it would cut a
sleeping system call short in a rank that goes on). A rank
whose sampler has not started yet is starting (given ``start_grace`` seconds before its silence
counts); once its sampler started (its record 0) it is running: a rank that never answers after
that (a native call holding the GIL from its first step) is not answering, not starting. Each
rank's last output lines go with its stack, and, while it is idle, the stacks of the processes
it forked (a DataLoader's workers, whose ``__getitem__`` is where a data-loader deadlock is).
While it is idle, its descendants' work counts too (a child, a pool or a DataLoader worker
that computes or reads: :meth:`RankView.descendants_working`), and a rank that returned while
its keeper still stops what it left is finished (:meth:`RankView.returned`).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from spark_torch.base.states import RankState
from spark_torch.node.rank_view import RankView
from spark_torch.shared.lines import RankOutput
from spark_torch.shared.stacks import (
    MAX_OUTPUT_CHARS,
    MAX_TRACE_BYTES,
    RankStack,
    StackState,
    strip_source_lines,
)
from spark_torch.shared.workdir_files import open_private, trace_path, trace_request_path

__all__ = ["ProgressWatch", "sample_interval", "NOT_ANSWERING_AFTER"]

#: a sampler silent for this many of its intervals (and at least 2 s) is not answering
NOT_ANSWERING_AFTER = 5


def sample_interval(stall_timeout: float) -> float:
    """How often ranks are sampled and nodes report: a tenth of the stall timeout, 0.2-1 s (a
    timeout or an interruption then shows stacks at most about a second old)."""
    return min(1.0, max(0.2, stall_timeout / 10))


@dataclass
class _Rank:
    file: str
    started: float
    progress: float
    seq: int = -1
    moved: int = -1
    sampled_at: float | None = None
    text: str = ""
    exited: bool = False
    #: the mtime of the Flight Recorder trace last sent (None: none yet)
    trace_sent: int | None = None
    #: its last output lines, and when it last wrote
    output: str = ""
    output_at: float = 0.0
    view: RankView = field(default_factory=RankView)


class _Observed:
    """A rank output that tells the watch about every block and exit, then hands them on."""

    def __init__(self, watch: ProgressWatch, inner: RankOutput) -> None:
        self._watch = watch
        self._inner = inner

    def __call__(self, rank: int, stream: str, block: str) -> None:
        self._watch.wrote(rank, block)
        self._inner(rank, stream, block)

    def flush(self) -> None:
        self._inner.flush()

    def rank_event(self, rank: int, state: RankState) -> None:
        if state is not RankState.STARTED:
            self._watch.exited(rank)
        self._inner.rank_event(rank, state)


class ProgressWatch:
    """Watches ``files`` ({rank: stack file}) and sends a snapshot every ``interval`` seconds."""

    def __init__(
        self,
        files: dict[int, str],
        interval: float,
        send: Callable[[list[dict[str, object]]], None],
        start_grace: float = 60.0,
        send_trace: Callable[[int, bytes], None] | None = None,
        source_lines: bool = True,
    ) -> None:
        now = time.monotonic()
        self._ranks = {rank: _Rank(file=path, started=now, progress=now) for rank, path in files.items()}
        self._interval = interval
        self._send = send
        self._send_trace = send_trace
        self._start_grace = start_grace
        self._source_lines = source_lines
        #: the driver stops the ranks: those that do not answer are asked for their true stacks
        self._dump_wanted = False
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="spark-torch-progress-watch", daemon=True)

    def observing(self, output: RankOutput) -> RankOutput:
        """``output``, telling this watch about the ranks' output and exits."""
        return _Observed(self, output)

    def wrote(self, rank: int, block: str) -> None:
        """The rank wrote ``block`` now (its last lines are kept for its stack)."""
        state = self._ranks.get(rank)
        if state is not None:
            state.output_at = time.monotonic()
            state.output = (state.output + block + "\n")[-MAX_OUTPUT_CHARS:]  # a block has no trailing newline

    def started(self, rank: int, pid: int) -> None:
        """The rank's process is ``pid`` (looked at from outside when its sampler is silent)."""
        state = self._ranks.get(rank)
        if state is not None:
            state.view = RankView(pid)

    def exited(self, rank: int) -> None:
        """The rank's process ended."""
        state = self._ranks.get(rank)
        if state is not None:
            state.exited = True
            state.progress = time.monotonic()

    def start(self) -> None:
        """Start watching (the ranks were started)."""
        self._thread.start()

    def request_traces(self, stopping: bool = False) -> None:
        """Ask every running rank for its Flight Recorder trace (the driver saw a stall); each
        arrives through ``send_trace`` as its rank writes it. With ``stopping`` (the driver is
        about to stop the ranks) a rank that does not answer is asked for its faulthandler stack
        instead: a signal, which cuts a sleeping system call short, so never sent to a rank that
        goes on (``stall_action="warn"``)."""
        if stopping:
            self._dump_wanted = True
            return
        for state in self._ranks.values():
            if not state.exited:
                try:
                    with open_private(trace_request_path(state.file)) as fh:
                        fh.write(str(time.time()))
                except OSError:
                    pass  # the workdir is going away: the run is ending

    def _forward_traces(self) -> None:
        if self._send_trace is None:
            return
        for rank, state in sorted(self._ranks.items()):
            path = trace_path(state.file)
            try:
                info = os.stat(path)
                if info.st_mtime_ns == state.trace_sent or info.st_size > MAX_TRACE_BYTES:
                    continue
                with open(path, "rb") as fh:
                    data = fh.read(MAX_TRACE_BYTES + 1)
            except OSError:
                continue
            state.trace_sent = info.st_mtime_ns
            if 0 < len(data) <= MAX_TRACE_BYTES:
                self._send_trace(rank, data)

    def _read(self, state: _Rank, now: float) -> None:
        try:
            with open(state.file, encoding="utf-8") as fh:
                sample = json.load(fh)
            seq, moved, text = int(sample["seq"]), int(sample["moved"]), str(sample["stack"])
            thread, pid = int(sample.get("thread", 0)), int(sample.get("pid", 0))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return  # not written yet, or being replaced: the next round reads it
        if seq != state.seq:
            if state.seq == -1:
                state.progress = now  # its sampler started (record 0): the rank runs from now on
            state.seq, state.sampled_at, state.text = seq, now, text
            state.view.thread = thread
            state.view.adopt(pid)  # the rank under its keeper: looked at, and signalled, itself
        if moved != state.moved:
            if state.moved != -1:
                state.progress = now
            state.moved = moved

    def _stack(self, rank: int, state: _Rank, now: float) -> RankStack:
        if state.exited:
            return RankStack(rank, state.text, now - state.progress, StackState.EXITED, output=state.output)
        self._read(state, now)
        if state.sampled_at is None:
            if state.output_at > state.progress:
                state.progress = state.output_at  # a rank that is starting: its output is all we see
            idle = max(0.0, now - max(state.started + self._start_grace, state.progress))
            return RankStack(rank, "", idle, StackState.STARTING, output=state.output)
        age = now - state.sampled_at
        text, kind = state.text, StackState.SAMPLED
        if age > 2 * self._interval and state.view.returned():  # its keeper stops what it left
            state.exited, state.progress = True, now
            return RankStack(rank, state.text, 0.0, StackState.EXITED, output=state.output)
        # a rank that never sampled after its record 0 could not run its sampler from the start
        silent = max(NOT_ANSWERING_AFTER * self._interval, 2.0) if state.seq > 0 else max(3 * self._interval, 1.0)
        if age > silent:
            if state.view.stopped():
                kind = StackState.STOPPED
            else:
                kind = StackState.NOT_ANSWERING
                if state.view.computing(self._interval / 4) or state.output_at > state.progress:
                    state.progress = now  # a native call holding the GIL, computing or writing
                text = state.view.native_stack(state.file, ask=self._dump_wanted) or text
        if now - state.progress > 2 * self._interval and state.view.descendants_working(state.file, self._interval):
            state.progress = now  # its child, pool or DataLoader worker computes or reads
        idle = now - state.progress
        if idle > 2 * self._interval:
            text += state.view.children_stacks(state.file)
        if not self._source_lines:
            text = strip_source_lines(text)
        return RankStack(rank, text, idle, kind, age, output=state.output)

    def snapshot(self) -> list[RankStack]:
        """Every rank's stack and idle time, now."""
        now = time.monotonic()
        with self._lock:
            return [self._stack(rank, state, now) for rank, state in sorted(self._ranks.items())]

    def _report(self) -> None:
        try:
            self._send([s.to_dict() for s in self.snapshot()])
            self._forward_traces()
        except Exception:  # noqa: BLE001 - a closed channel: the run is ending anyway
            pass

    def _loop(self) -> None:
        while not self._closed.wait(self._interval):
            self._report()

    def close(self) -> None:
        """Stop watching, after one last snapshot (the exits the driver may not have heard of)."""
        if self._closed.is_set():
            return
        self._closed.set()
        if self._thread.is_alive():
            self._thread.join(self._interval + 2.0)
            self._report()
