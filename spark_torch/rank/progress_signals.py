"""Whether a rank's main thread made progress since the last sample: the signals combined.

A rank makes progress when its process groups start a collective or a point-to-point op (the
sum of torch's per-group sequence numbers, :func:`collective_count`, moved: in a program that
waits for each, the one before completed; a rank that waits 0.3 s for data or in ``recv`` between
collectives is working), or when its main thread

- calls ``report()`` (:func:`spark_torch.shared.stacks.progress_count`), or waits in its checkpoint
  upload (:func:`spark_torch.shared.stacks.working`, however slow the link),
- reads or writes anything (its own read/write counters, ``/proc/self/task/<tid>/io``: the
  sampler's own writes and another thread's output are not counted), or pages memory in (its
  page faults: a library being loaded by ``import torch`` on a loaded machine),
- computes: its CPU time (``time.pthread_getcpuclockid``, read from the sampler's thread) was at
  least a tenth of the time since the last sample, or, judged over the whole time since its last
  progress (:func:`computing`), at least :data:`WINDOW_SHARE` of it or a whole sample interval
  (a thread starved of CPU on a loaded machine still computes), in Python or in a native call,
  unless it sits in a collective or a CUDA synchronize (which may spin at 100% CPU while NCCL hangs),
- reaches a position (stack and bytecode offset) it was never seen at before,
- waits on another thread (a join, an Event, a queue) while the process's other threads compute
  (their CPU time, without the sampler's own, at least a tenth of the time since the last sample)
  or move data (their bytes read and written, without the sampler's own, at least
  :data:`OTHERS_IO_BYTES` since the last sample: an upload on fsspec's IO thread).

A main thread that cycles through waits (a timed queue get, ``event.wait(1)`` in a loop, a
DataLoader polling its workers, ``time.sleep`` in a loop) and starts no collective meanwhile does
none of these: it revisits the same few positions with next to no CPU time (microseconds a
wake-up: a whole interval's worth takes hours) and no I/O. Without a CPU clock (not Linux), a move
of the innermost frame's bytecode offset counts instead: a Python loop sampled from another
thread sits at its backward jump, a blocked thread at its call.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass

from spark_torch.shared.stacks import is_working, progress_count

__all__ = ["Progress", "Reading", "computing", "in_collective", "collective_count"]

#: frames that mean "waiting for a collective or the GPU": CPU time there is not progress
_COLLECTIVE_FILES = (
    os.path.join("torch", "distributed", "distributed_c10d.py"),
    os.path.join("torch", "distributed", "c10d_logger.py"),
)
_CUDA_DIR = os.path.join("torch", "cuda", "")
#: bytes the other threads must read or write between two samples while the main thread waits on
#: one of them (a store's polling, NCCL's heartbeat monitor, move far less)
OTHERS_IO_BYTES = 16 * 1024
#: distinct positions remembered; a rank that visits more is moving anyway
_MAX_POSITIONS = 512
#: the share of the time since its last progress that a thread's CPU time must reach to count as
#: computing: a rank that gets a fiftieth of a core over the stall window (more than 100 busy
#: threads on 2 cores) computes; a main thread that only cycles through waits uses microseconds a
#: wake-up (a ``time.sleep(0.01)`` loop: under 0.5%)
WINDOW_SHARE = 0.02
#: the share of one sample's time that counts as computing at once
SAMPLE_SHARE = 0.1
#: CPU seconds below this are never computing (one wake-up, however slow)
MIN_CPU = 0.001


def computing(cpu: float, wall: float, interval: float, share: float = WINDOW_SHARE) -> bool:
    """Whether ``cpu`` CPU seconds over ``wall`` seconds are computing: more than :data:`MIN_CPU`
    and at least ``share`` of ``wall``, or a whole sample ``interval`` (however long ``wall``)."""
    return cpu > MIN_CPU and (cpu >= share * wall or cpu >= interval)


@dataclass(frozen=True)
class Reading:
    """The signals of one sample, as :class:`Progress` reads them (None: not readable here)."""

    #: ``time.monotonic()`` of the sample
    at: float
    #: the thread's CPU seconds
    cpu: float | None
    #: the thread's bytes read and written, and its minor and major page faults
    io: tuple[int, int, int, int] | None
    #: ``report()`` calls in the process
    reports: int
    #: in a checkpoint upload
    working: bool
    #: collectives the process's process groups started
    collectives: int | None
    #: CPU seconds of the process without the sampler's thread
    others: float
    #: bytes the process read and wrote without the sampler's thread
    others_bytes: int | None


def in_collective(frames: list[tuple[str, int, str]]) -> bool:
    """The thread waits in a torch.distributed call or a CUDA synchronize."""
    for filename, _, name in frames:
        if any(part in filename for part in _COLLECTIVE_FILES):
            return True
        if _CUDA_DIR in filename and name == "synchronize":
            return True
    return False


def collective_count() -> int | None:
    """How many collectives and point-to-point ops this process's process groups started: the
    sum of torch's per-group sequence numbers (gloo counts both; NCCL's counts its collectives),
    read from any thread without the main thread's help (a counter under the group's own lock,
    never a wait); None while torch.distributed is not in use."""
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    world = getattr(c10d, "_world", None) if c10d is not None else None
    if world is None:
        return None
    try:
        groups = list(world.pg_map)  # a copy under the GIL: the main thread may add or destroy one
    except Exception:  # noqa: BLE001 - a torch without it, or torch shutting down
        return None
    total = 0
    for group in groups:
        try:
            total += int(group._get_sequence_number_for_group())
        except Exception:  # noqa: BLE001 - a group being destroyed, a backend without the counter
            continue
    del groups  # hold no process group past the sample
    return total


def _thread_clock(ident: int) -> int | None:
    try:
        clock = time.pthread_getcpuclockid(ident)
        time.clock_gettime(clock)
    except (AttributeError, OSError, OverflowError):
        return None
    return clock


class Progress:
    """The progress signals of one thread (the main thread: ``ident``, ``native_id``):
    :meth:`read` reads them, :meth:`judge` decides from two readings (pure: no clock, no
    ``/proc``), :meth:`moved` does both."""

    def __init__(self, ident: int, native_id: int, interval: float, collectives: bool = True) -> None:
        self._clock = _thread_clock(ident)
        self._io_path = f"/proc/self/task/{native_id}/io"
        self._stat_path = f"/proc/self/task/{native_id}/stat"
        #: CPU seconds since the last progress (its own, and those of the threads it waits on) that
        #: count as computing, however slowly
        self._busy = interval
        #: a forked child (a DataLoader worker) never reads them: a process group's lock held by
        #: another thread at the fork would stay held in the child, and its sampler holds the GIL
        self._count_collectives = collectives
        self._last = self.read()
        #: when it last made progress (it starts with none: from its first reading)
        self._since = self._last.at
        self._cpu_since = 0.0
        self._seen: set[object] = set()

    def read(self) -> Reading:
        """The thread's signals now."""
        return Reading(
            at=time.monotonic(),
            cpu=self._cpu_time(),
            io=self._io_counters(),
            reports=progress_count(),
            working=is_working(),
            collectives=collective_count() if self._count_collectives else None,
            others=self._others_time(),
            others_bytes=self._process_bytes(),
        )

    def _cpu_time(self) -> float | None:
        if self._clock is None:
            return None
        try:
            return time.clock_gettime(self._clock)
        except OSError:  # the thread ended
            return None

    @staticmethod
    def _others_time() -> float:
        """CPU time of the process without the calling (sampler) thread's."""
        return time.process_time() - time.thread_time()

    @staticmethod
    def _bytes(path: str) -> int | None:
        """rchar + wchar of a ``/proc`` io file."""
        try:
            with open(path, "rb") as fh:
                fields = dict(line.split(b":", 1) for line in fh.read(4096).splitlines() if b":" in line)
            return int(fields[b"rchar"]) + int(fields[b"wchar"])
        except (OSError, KeyError, ValueError):
            return None

    def _process_bytes(self) -> int | None:
        """Bytes the process read and wrote, without the calling (sampler) thread's."""
        total, own = self._bytes("/proc/self/io"), self._bytes("/proc/thread-self/io")
        return None if total is None or own is None else total - own

    def _io_counters(self) -> tuple[int, int, int, int] | None:
        """The thread's bytes read and written, and its page faults (a library being loaded,
        ``import torch``: its pages come by mmap, not by read)."""
        try:
            with open(self._io_path, "rb") as fh:
                fields = dict(line.split(b":", 1) for line in fh.read(4096).splitlines() if b":" in line)
            with open(self._stat_path, "rb") as fh:
                stat = fh.read(4096)
            faults = stat[stat.rfind(b")") + 2 :].split()
            return int(fields[b"rchar"]), int(fields[b"wchar"]), int(faults[7]), int(faults[9])
        except (OSError, KeyError, ValueError, IndexError):
            return None

    def moved(
        self, position: object, lasti: int, frames: list[tuple[str, int, str]], waits_on_a_thread: bool = False
    ) -> bool:
        """Whether the thread made progress since the last call (``position``: its stack as
        the user sees it, ``lasti``: the innermost frame's bytecode offset, ``frames``: all of
        them; ``waits_on_a_thread``: it waits on another thread of the process)."""
        return self.judge(self.read(), position, lasti, frames, waits_on_a_thread)

    def judge(
        self,
        now: Reading,
        position: object,
        lasti: int,
        frames: list[tuple[str, int, str]],
        waits_on_a_thread: bool = False,
    ) -> bool:
        """:meth:`moved` with the reading ``now`` given: whether it shows progress since the last one."""
        last, self._last = self._last, now
        collective = in_collective(frames)
        used = 0.0
        if now.cpu is not None and last.cpu is not None and not collective:
            used = max(0.0, now.cpu - last.cpu)
            self._cpu_since += used
        busy = computing(used, now.at - last.at, float("inf"), SAMPLE_SHARE)
        if waits_on_a_thread and not collective:
            helped = max(0.0, now.others - last.others - used)  # the threads it waits on computing for it
            self._cpu_since += helped  # however slowly (a loaded machine), as its own CPU time counts
            busy = busy or computing(helped, now.at - last.at, float("inf"), SAMPLE_SHARE)
            ours, before = now.io, last.io
            if (
                now.others_bytes is not None
                and last.others_bytes is not None
                and ours is not None
                and before is not None
            ):
                main_bytes = ours[0] + ours[1] - before[0] - before[1]
                busy = busy or now.others_bytes - last.others_bytes - main_bytes >= OTHERS_IO_BYTES
        key = (position, lasti) if self._clock is None else position
        new = key not in self._seen
        if new:
            if len(self._seen) >= _MAX_POSITIONS:
                self._seen.clear()
            self._seen.add(key)
        progressed = (
            now.reports != last.reports
            or now.working
            or now.collectives != last.collectives
            or (now.io is not None and last.io is not None and now.io != last.io)
            or busy
            or computing(self._cpu_since, now.at - self._since, self._busy)
            or (new and len(self._seen) > 1)
        )
        if progressed:
            self._cpu_since = 0.0
            self._since = now.at
        return progressed
