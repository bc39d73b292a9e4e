"""The ranks' Flight Recorder traces on the driver (asked for when a stall is found): written to
files and summed up in a few lines, off the thread that received them.

A node's connection thread (or, in local mode, the node's progress thread) hands a trace to
:meth:`FlightRecorder.receive`, which only queues it (a bounded queue: a full one drops the
trace, never blocks) and never raises: a bad trace is never the connection's fault. One worker
thread writes each as ``rank_R.json`` into the attempt's folder (:func:`trace_dir`: checked
like ``log_dir``'s files, :mod:`spark_torch.shared.owned_files`) and reads it
(:func:`spark_torch.shared.fr_dumps.read_dump`) for the summary the stall message shows.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from spark_torch.shared.fr_dumps import Dump, read_dump, summary
from spark_torch.shared.owned_files import UnsafePathError, open_own_file, own_directory, private_folder
from spark_torch.shared.stacks import MAX_TRACE_BYTES

__all__ = ["FlightRecorder", "TraceDir", "trace_dir", "TRACE_FILE"]

logger = logging.getLogger(__name__)

#: how the traces' files are named (torch's Flight Recorder JSON dump, one per rank)
TRACE_FILE = "rank_{rank}.json"
#: traces waiting for the writer; more are dropped (each is at most MAX_TRACE_BYTES)
QUEUE_SIZE = 64


@dataclass(frozen=True)
class TraceDir:
    """Where an attempt's traces go: ``root`` (the user's ``log_dir`` or the temporary
    directory, used as it is) and the folders below it, each created 0700 or checked to be this
    user's and not writable by others; with ``private``, the first must be readable by nobody
    else either (a per-user folder in the shared temporary directory)."""

    root: str
    parts: tuple[str, ...]
    private: bool = False

    @property
    def path(self) -> str:
        """The folder's path."""
        return os.path.join(self.root, *self.parts)

    def open(self) -> int:
        """A descriptor of the folder, each level created or checked through its parent's
        descriptor (a level cannot be swapped for a link between the check and the use)."""
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        path = self.root
        try:
            for index, part in enumerate(self.parts):
                path = os.path.join(path, part)
                try:
                    child = own_directory(part, private=self.private and index == 0, dir_fd=fd)
                except UnsafePathError as exc:
                    raise UnsafePathError(path, exc.reason) from None
                os.close(fd)
                fd = child
        except BaseException:
            os.close(fd)
            raise
        return fd


def trace_dir(log_dir: str | None, run_id: str, attempt: int) -> TraceDir | None:
    """``log_dir/flight-recorder/attempt-N``, or without ``log_dir`` this user's
    ``$TMPDIR/spark_torch_traces-UID/RUN_ID/attempt-N`` (if that folder is another user's or
    others may use it: a private folder of this process, :func:`~spark_torch.shared.owned_files.private_folder`);
    N is the attempt's index in the run's history (``AttemptRecord.attempt``: it counts on
    across runs that resume from the same storage). None: no private folder could be had."""
    if log_dir:
        return TraceDir(log_dir, ("flight-recorder", f"attempt-{attempt}"))
    try:
        folder = private_folder("spark_torch_traces")
    except OSError as exc:
        logger.warning("spark_torch: no private folder for Flight Recorder traces (%s); none are written", exc)
        return None
    return TraceDir(os.path.dirname(folder), (os.path.basename(folder), run_id, f"attempt-{attempt}"), private=True)


def _write_trace(folder: int, rank: int, data: bytes) -> None:
    """``rank_R.json`` in the folder ``folder`` (a descriptor), replacing an older one."""
    fd = open_own_file(TRACE_FILE.format(rank=rank), append=False, dir_fd=folder)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)


class FlightRecorder:
    """One attempt's traces: the files, each rank's dump and the summary (module docstring)."""

    def __init__(self, world_size: int, where: TraceDir | None) -> None:
        self.world_size = world_size
        self.where = where
        self._queue: queue.Queue[tuple[int, bytes] | None] = queue.Queue(QUEUE_SIZE)
        self._arrived = threading.Condition()
        self._dumps: dict[int, Dump | str] = {}
        self._asked: set[int] = set()
        #: a message said where the traces go before they all came: their summary is logged when
        #: they have (once per request; a message that already held it is not repeated)
        self._announce = False
        self._problem: str | None = None
        self._folder: int | None = None
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._closed = False

    def receive(self, rank: Any, data: Any) -> None:
        """A rank's trace as a node sent it; queued for the writer, dropped if malformed or if
        the writer is behind. Never blocks, never raises."""
        try:
            if self.where is None or isinstance(rank, bool) or not isinstance(rank, int):
                return
            if not 0 <= rank < self.world_size or not isinstance(data, bytes) or not 0 < len(data) <= MAX_TRACE_BYTES:
                return
            self._start()
            self._queue.put_nowait((rank, data))
        except Exception:  # noqa: BLE001 - a trace is extra: it never breaks the channel that carried it
            logger.debug("spark_torch: a Flight Recorder trace was dropped", exc_info=True)

    def _start(self) -> None:
        with self._start_lock:
            if self._closed:
                raise RuntimeError("the attempt's Flight Recorder is closed")  # a trace after the attempt: dropped
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="spark-torch-flight-recorder", daemon=True)
                self._thread.start()

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                self._store(*item)
            except Exception:  # noqa: BLE001 - the writer must outlive any one trace
                logger.debug("spark_torch: a Flight Recorder trace could not be stored", exc_info=True)

    def _store(self, rank: int, data: bytes) -> None:
        self._write(rank, data)
        dump = read_dump(data)
        with self._arrived:
            self._dumps[rank] = dump
            self._arrived.notify_all()
            complete = bool(self._asked) and self._asked <= set(self._dumps)
            if complete:
                self._asked = set()  # said once per request
            announce, self._announce = (self._announce, False) if complete else (False, self._announce)
            lines = self._lines()
        if announce:
            logger.warning(
                "spark_torch: torch's Flight Recorder, the collectives in flight on each rank (JSON per rank in "
                "%s):\n%s",
                self.where.path if self.where else "",
                "\n".join(f"  {line}" for line in lines),
            )

    def _write(self, rank: int, data: bytes) -> None:
        if self.where is None or self._problem is not None:
            return
        try:
            if self._folder is None:
                self._folder = self.where.open()
            _write_trace(self._folder, rank, data)
        except OSError as exc:  # UnsafePathError included: said once, the summary still comes
            self._problem = str(exc)
            logger.warning(
                "spark_torch: the ranks' Flight Recorder traces are not written: %s; remove it or choose another "
                "log_dir",
                exc,
            )

    def ask(self, request: Callable[[], None] | None, running: Iterable[int], wait: float) -> None:
        """Ask the nodes (``request``) for the ``running`` ranks' traces; wait up to ``wait``
        seconds for them all."""
        if request is None or self.where is None:
            return
        running = set(running)
        with self._arrived:
            self._asked = set(running)
            self._announce = False
        try:
            request()
        except Exception:  # noqa: BLE001 - traces are extra: a failure to ask must not break the run
            logger.debug("spark_torch: could not ask for Flight Recorder traces", exc_info=True)
            return
        with self._arrived:
            self._arrived.wait_for(lambda: running <= set(self._dumps), timeout=wait)

    def _lines(self) -> list[str]:
        dumps: dict[int, Dump | str | None] = dict(self._dumps)
        for rank in self._asked:
            dumps.setdefault(rank, None)
        return summary(dumps)

    def note(self) -> str:
        """The traces' part of a stall message: the summary so far, or where they will go."""
        if self.where is None:
            return ""
        with self._arrived:
            lines = self._lines() if self._dumps else []
            self._announce = bool(self._asked)  # not all of them yet: the summary follows when they are
        where = self.where.path if self._problem is None else f"nowhere: {self._problem}"
        if lines:
            return (
                f"\ntorch's Flight Recorder, the collectives in flight on each rank (JSON per rank in {where}):\n"
                + "\n".join(f"  {line}" for line in lines)
            )
        return f"\nThe ranks' Flight Recorder traces (torch's record of their collectives) go to {where}"

    def close(self) -> None:
        """Let the writer finish what it has (bounded) and close the folder."""
        with self._start_lock:
            self._closed = True
        if self._thread is not None:
            try:
                self._queue.put(None, timeout=2.0)
            except queue.Full:
                pass
            self._thread.join(5.0)
        if self._folder is not None and (self._thread is None or not self._thread.is_alive()):
            os.close(self._folder)
            self._folder = None
