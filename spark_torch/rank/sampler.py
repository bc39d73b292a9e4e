"""A rank's stack sampler: where its main thread is, and whether it makes progress, for stall detection.

A daemon thread samples the main thread every ``SPARK_TORCH_SAMPLE_SECONDS`` and writes one
record into ``SPARK_TORCH_STACK_FILE`` (a temporary file renamed over it, so the node never reads
half a sample): ``seq`` grows with every sample (a node that sees it stand still knows the rank
is not answering; record 0, written when the sampler starts, before the rank's own code, has no
stack: a rank whose first sample never comes holds the GIL from its first step), ``moved`` with every sample in which
the rank made progress
(:class:`Progress`), ``pid`` and ``thread`` name the process and its main thread, ``stack`` is
the text.

It holds no user object beyond one sample and calls no user code: it walks frames through their
code objects and line numbers only (never ``f_locals``, which on Python 3.10-3.12 would keep a
dict of the frame's locals alive on the frame, nor ``__eq__``/``__hash__``/``__repr__`` of
anything the user made), and reads source lines from the files itself.

A native call that holds the GIL stops this thread; only when the run is being stopped anyway
(``stall_action="fail"``) does the node ask faulthandler, registered here for
:data:`spark_torch.shared.stacks.DUMP_SIGNAL_OFFSET` above ``SIGRTMIN``, for the true stack (it dumps
without the GIL; the signal would cut a sleeping system call short in a rank that goes on). Forked children (a
DataLoader's workers) sample themselves into
``<stack file>.child-<pid>``. When the node asks (a stall), the sampler also writes torch's
Flight Recorder record of the collectives still in flight (:func:`trace_path`).
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import threading
import time
from types import FrameType
from typing import IO, Any

from spark_torch.base import envnames
from spark_torch.rank.progress_signals import Progress
from spark_torch.rank.shutdown import own_descriptor
from spark_torch.shared.fr_dumps import keep_tail
from spark_torch.shared.stacks import (
    DUMP_SIGNAL_OFFSET,
    MAX_STACK_CHARS,
    MAX_TRACE_BYTES,
    cut_head,
    cut_tail,
)
from spark_torch.shared.workdir_files import (
    child_stack_path,
    native_dump_path,
    open_private,
    trace_path,
    trace_request_path,
)

__all__ = ["start_sampler"]


def _flight_recorder_trace() -> bytes | None:
    """torch's Flight Recorder record of the collectives still in flight in this process, as
    JSON, or None: torch.distributed not in use, or a torch without the recorder."""
    distributed = sys.modules.get("torch.distributed")
    if distributed is None or not distributed.is_available() or not distributed.is_initialized():
        return None
    c10d = sys.modules["torch"]._C._distributed_c10d
    # NCCL keeps a recorder of its own (a CUDA build's ProcessGroupNCCL); the generic one holds
    # gloo's collectives. A dump without "entries" recorded nothing: try the next one.
    data: Any = None
    for name in ("_dump_nccl_trace_json", "_dump_fr_trace_json"):
        dump = getattr(c10d, name, None)
        if dump is None:
            continue
        data = dump(True, True)  # the collectives, only those still active
        if data and '"entries"' in (data if isinstance(data, str) else bytes(data).decode("utf-8", "replace")):
            break
    return data.encode("utf-8") if isinstance(data, str) else bytes(data) if data else None


#: where the launcher's frames end: the rank entry's ``main`` (then runpy's, for a script)
_ENTRY_DIR = os.path.join("spark_torch", "rank", "")
_PACKAGE_DIR = os.path.join("spark_torch", "")
#: a frame in one of these is waiting for another thread: show the other threads too
_THREAD_WAITS = (
    os.path.join("", "threading.py"),
    os.path.join("", "queue.py"),
    os.path.join("concurrent", "futures", ""),
)

#: (filename, line number, function name), innermost last
Frame = tuple[str, int, str]


def _walk(frame: FrameType | None) -> list[Frame]:
    """A thread's frames, outermost first: code objects and line numbers only."""
    frames: list[Frame] = []
    while frame is not None:
        code = frame.f_code
        frames.append((code.co_filename, frame.f_lineno or 0, code.co_name))
        frame = frame.f_back
    frames.reverse()
    return frames


def _user_frames(frames: list[Frame]) -> list[Frame]:
    """The main thread's frames from the user's first on (the template, runpy and the rank
    entry module are spark_torch's launcher), and spark_torch's own frames under a user's call
    cut to the first (``report``: "in spark_torch.report()", not an internal function)."""
    entry = max((i for i, f in enumerate(frames) if _ENTRY_DIR in f[0] and f[2] == "main"), default=-1)
    rest = frames[entry + 1 :]
    while rest and "runpy" in rest[0][0]:
        rest = rest[1:]
    for i, (filename, _, _) in enumerate(rest):
        if _PACKAGE_DIR in filename and _ENTRY_DIR not in filename:
            return rest[: i + 1]
    return rest or frames[-1:]


def _child_frames(frames: list[Frame]) -> list[Frame]:
    """A forked child's frames from what it runs on (a multiprocessing Process's target)."""
    start = max((i for i, f in enumerate(frames) if f[2] == "_bootstrap" and "multiprocessing" in f[0]), default=-1)
    return frames[start + 1 :] or frames


class _Sources:
    """Source lines read from the files themselves (linecache could call a module's loader)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._files: dict[str, list[str]] = {}

    def line(self, filename: str, lineno: int) -> str:
        if not self.enabled:
            return ""
        lines = self._files.get(filename)
        if lines is None:
            try:
                with open(filename, encoding="utf-8", errors="replace") as fh:
                    lines = fh.read(4_000_000).splitlines()
            except (OSError, ValueError):
                lines = []
            if len(self._files) > 256:
                self._files.clear()
            self._files[filename] = lines
        return lines[lineno - 1].strip() if 0 < lineno <= len(lines) else ""


def _text(frames: list[Frame], sources: _Sources) -> str:
    parts = []
    for filename, lineno, name in frames:
        parts.append(f'  File "{filename}", line {lineno}, in {name}\n')
        source = sources.line(filename, lineno)
        if source:
            parts.append(f"    {source}\n")
    return cut_tail("".join(parts), MAX_STACK_CHARS)  # whole frames: a cut never leaves part of a line


def _other_threads(main_id: int, own_id: int, sources: _Sources) -> str:
    blocks = []
    names = {t.ident: t.name for t in threading.enumerate()}
    current = sys._current_frames()
    try:
        for ident, frame in current.items():
            if ident in (main_id, own_id) or str(names.get(ident, "")).startswith("spark-torch-"):
                continue
            blocks.append(f"  Thread {names.get(ident, ident)}:\n" + _text(_walk(frame), sources))
    finally:
        del current
    return "\n".join(blocks)


def _waits_on_a_thread(frames: list[Frame]) -> bool:
    """The main thread waits on another thread (a join, an Event, a queue)."""
    return any(part in frames[-1][0] for part in _THREAD_WAITS) if frames else False


class _Sampler:
    def __init__(
        self, path: str, interval: float, all_threads: bool, child: bool = False, source_lines: bool = True
    ) -> None:
        self.path = path
        self.interval = interval
        self.all_threads = all_threads
        self.child = child
        main = threading.main_thread()
        self.main_id = main.ident or 0
        self.progress = Progress(self.main_id, main.native_id or os.getpid(), interval, collectives=not child)
        #: without source lines (stall_source_lines=False) none is read: none can be in a stack's text
        self.sources = _Sources(source_lines)
        self.seq = 0
        self.moved = 0
        #: the trace request last served (its file's mtime)
        self.served: int | None = None
        #: this sampler's own thread (its node leaves its CPU time and reads out of a child's work)
        self.native_id = 0

    def sample(self) -> None:
        current = sys._current_frames()
        try:
            frame = current.get(self.main_id)
            everything = _walk(frame)
            lasti = frame.f_lasti if frame is not None else -1
        finally:
            frame = None
            del current  # no frame outlives the sample
        frames = _child_frames(everything) if self.child else _user_frames(everything)
        self.seq += 1
        waits = _waits_on_a_thread(everything)
        if self.progress.moved(tuple(frames), lasti, everything, waits):
            self.moved += 1
        text = _text(frames, self.sources)
        if self.all_threads or waits:
            others = _other_threads(self.main_id, threading.get_ident(), self.sources)
            if others:
                text += "\n" + cut_head(others, MAX_STACK_CHARS)
        self.write(text)

    def write(self, text: str) -> None:
        """One record (seq 0, no stack: the sampler started, before the rank's own code runs)."""
        record = {
            "seq": self.seq,
            "moved": self.moved,
            "time": time.time(),
            "stack": text,
            "pid": os.getpid(),
            "thread": self.main_id,
            "sampler": self.native_id,
        }
        temporary = f"{self.path}.{os.getpid()}.tmp"
        with open_private(temporary, "w") as fh:
            json.dump(record, fh)
        os.replace(temporary, self.path)

    def serve_trace_request(self) -> None:
        """The node asked for this rank's Flight Recorder trace (a stall): write it next to the
        stack file, once per request."""
        if self.child:
            return
        request = trace_request_path(self.path)
        try:
            asked = os.stat(request).st_mtime_ns
        except OSError:
            return
        if asked == self.served:
            return
        self.served = asked
        data = _flight_recorder_trace()
        if data is None:
            return
        data = keep_tail(data, MAX_TRACE_BYTES)  # a long run's record: its newest entries
        temporary = f"{self.path}.{os.getpid()}.trace.tmp"
        with open_private(temporary, "wb") as fh:
            fh.write(data)
        os.replace(temporary, trace_path(self.path))

    def loop(self) -> None:
        self.native_id = threading.get_native_id()
        while True:
            time.sleep(self.interval)  # first after one interval: not inside start_sampler()
            for step in (self.sample, self.serve_trace_request):
                try:
                    step()
                except Exception:  # noqa: BLE001 - a sampler must never disturb the rank (shutdown, full disk)
                    pass


#: the file faulthandler dumps into (kept open for the rank's life)
_dump_file: IO[str] | None = None


def _register_dump(path: str) -> None:
    """faulthandler dumps every thread's stack into ``path`` on the node's signal, without the GIL."""
    global _dump_file
    try:
        _dump_file = open_private(
            native_dump_path(path), "a"
        )  # open for the rank's life; appended: the node truncates it
        own_descriptor(_dump_file.fileno())  # faulthandler writes it directly: nothing to flush at exit
        faulthandler.register(signal.SIGRTMIN + DUMP_SIGNAL_OFFSET, file=_dump_file, all_threads=True, chain=False)
    except (OSError, AttributeError, ValueError, RuntimeError):
        _dump_file = None  # no real-time signals here: a rank holding the GIL keeps its last stack


def _start(path: str, interval: float, all_threads: bool, child: bool, source_lines: bool) -> None:
    sampler = _Sampler(path, interval, all_threads, child, source_lines)
    if not child:
        try:  # the node knows from now on that the rank runs: a silence from here is not set-up
            sampler.write("")
        except (OSError, ValueError):
            pass
    threading.Thread(target=sampler.loop, name="spark-torch-stack-sampler", daemon=True).start()


def start_sampler(environ: dict[str, str] | None = None) -> bool:
    """Start sampling when the node asked for it (``SPARK_TORCH_STACK_FILE`` is set); whether it started."""
    env = os.environ if environ is None else environ
    path = env.get(envnames.STACK_FILE)
    if not path:
        return False
    try:
        interval = max(0.05, float(env.get(envnames.SAMPLE_SECONDS, "1")))
    except ValueError:
        interval = 1.0
    all_threads = env.get(envnames.STACK_ALL_THREADS) == "1"
    source_lines = env.get(envnames.STACK_SOURCE_LINES, "1") != "0"
    _register_dump(path)
    _start(path, interval, all_threads, child=False, source_lines=source_lines)
    rank_pid = os.getpid()

    def in_child() -> None:  # a forked child (a DataLoader worker): its own sampler, its own file
        if os.getppid() == rank_pid:
            try:
                _start(
                    child_stack_path(path, os.getpid()), interval, all_threads, child=True, source_lines=source_lines
                )
            except Exception:  # noqa: BLE001 - never disturb the child
                pass

    os.register_at_fork(after_in_child=in_child)
    return True
