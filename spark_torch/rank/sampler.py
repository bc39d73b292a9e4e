"""A rank's stack sampler: where its main thread is, for stall detection.

A daemon thread samples the main thread's Python stack every ``SPARK_TORCH_SAMPLE_SECONDS``
(``sys._current_frames``: no ptrace, no signal, nothing the user's code owns) and writes it with
two counters into ``SPARK_TORCH_STACK_FILE`` (a temporary file renamed over it, so the node never
reads half a sample): ``seq`` grows with every sample (a node that sees it stand still knows the
rank is not answering: a native call holding the GIL), ``moved`` with every sample whose
position differs from the one before (a frame, a line, the bytecode offset of the innermost frame,
the local variables of the user's frames, or a report() call). The launcher's own frames (this package's rank entry, runpy) are left out.
When the node asks (a stall), it also writes torch's Flight Recorder record of the collectives
still in flight (:func:`trace_path`), if the rank uses torch.distributed.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from types import FrameType
from typing import Any

from spark_torch import envnames
from spark_torch.fr_dumps import keep_tail
from spark_torch.stacks import MAX_STACK_CHARS, MAX_TRACE_BYTES, progress_count, trace_path, trace_request_path

__all__ = ["start_sampler"]


def _flight_recorder_trace() -> bytes | None:
    """torch's Flight Recorder record of the collectives still in flight in this process, as
    JSON, or None: torch.distributed not in use, or a torch without the recorder."""
    distributed = sys.modules.get("torch.distributed")
    if distributed is None or not distributed.is_available() or not distributed.is_initialized():
        return None
    c10d = sys.modules["torch"]._C._distributed_c10d
    dump = getattr(c10d, "_dump_fr_trace_json", None) or getattr(c10d, "_dump_nccl_trace_json", None)
    if dump is None:
        return None
    data = dump(True, True)  # the collectives, only those still active
    return data.encode("utf-8") if isinstance(data, str) else bytes(data) if data else None

#: where the launcher's frames end: the rank entry's ``main`` (then runpy's, for a script)
_ENTRY_DIR = os.path.join("spark_torch", "rank", "")


def _user_frames(frame: FrameType | None) -> list[traceback.FrameSummary]:
    """The main thread's frames from the user's first on (the template, runpy and the rank
    entry module are spark_torch's launcher, not the user's code)."""
    frames = traceback.extract_stack(frame) if frame is not None else []
    entry = max((i for i, f in enumerate(frames) if _ENTRY_DIR in f.filename and f.name == "main"), default=-1)
    rest = frames[entry + 1 :]
    while rest and "runpy" in rest[0].filename:
        rest = rest[1:]
    return rest or frames[-1:]


def _token(value: Any) -> Any:
    """A value as it identifies a loop's state: small plain values by value, others by identity."""
    if type(value) in (int, float, bool) or (type(value) is str and len(value) <= 64):
        return value
    return id(value)


def _locals_digest(frame: FrameType | None, depth: int) -> int:
    """A digest of the local variables of the user's ``depth`` innermost frames.

    A tight Python loop is always paused at the same bytecode when the GIL changes hands (its
    backward jump), so its position alone looks like a rank that does not move; its loop
    variables do change. A blocked rank's locals do not."""
    tokens = []
    while frame is not None and depth > 0:
        tokens.append(tuple(_token(v) for v in frame.f_locals.values()))
        frame = frame.f_back
        depth -= 1
    return hash(tuple(tokens))


def _text(frames: list[traceback.FrameSummary]) -> str:
    text = "".join(traceback.format_list(frames))
    return text if len(text) <= MAX_STACK_CHARS else "  ...\n" + text[-MAX_STACK_CHARS:]


def _all_threads(main_id: int, own_id: int) -> str:
    blocks = []
    names = {t.ident: t.name for t in threading.enumerate()}
    for ident, frame in sys._current_frames().items():
        if ident in (main_id, own_id):
            continue
        blocks.append(f"  Thread {names.get(ident, ident)}:\n" + "".join(traceback.format_stack(frame)))
    return "\n".join(blocks)


class _Sampler:
    def __init__(self, path: str, interval: float, all_threads: bool) -> None:
        self.path = path
        self.interval = interval
        self.all_threads = all_threads
        self.main_id = threading.main_thread().ident or 0
        self.seq = 0
        self.moved = 0
        self.position: Any = None
        #: the trace request last served (its file's mtime)
        self.served: int | None = None

    def sample(self) -> None:
        frame = sys._current_frames().get(self.main_id)
        frames = _user_frames(frame)
        position = (
            tuple((f.filename, f.lineno, f.name) for f in frames),
            frame.f_lasti if frame is not None else -1,
            progress_count(),
            _locals_digest(frame, len(frames)),
        )
        self.seq += 1
        if position != self.position:
            self.moved += 1
            self.position = position
        text = _text(frames)
        if self.all_threads:
            others = _all_threads(self.main_id, threading.get_ident())
            if others:
                text += "\n" + others[: MAX_STACK_CHARS]
        record = {"seq": self.seq, "moved": self.moved, "time": time.time(), "stack": text}
        temporary = f"{self.path}.{os.getpid()}.tmp"
        with open(temporary, "w", encoding="utf-8") as fh:
            json.dump(record, fh)
        os.replace(temporary, self.path)

    def serve_trace_request(self) -> None:
        """The node asked for this rank's Flight Recorder trace (a stall): write it next to the
        stack file, once per request."""
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
        with open(temporary, "wb") as fh:
            fh.write(data)
        os.replace(temporary, trace_path(self.path))

    def loop(self) -> None:
        while True:
            time.sleep(self.interval)  # first after one interval: not inside start_sampler()
            for step in (self.sample, self.serve_trace_request):
                try:
                    step()
                except Exception:  # noqa: BLE001 - a sampler must never disturb the rank (shutdown, full disk)
                    pass


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
    sampler = _Sampler(path, interval, env.get(envnames.STACK_ALL_THREADS) == "1")
    threading.Thread(target=sampler.loop, name="spark-torch-stack-sampler", daemon=True).start()
    return True
