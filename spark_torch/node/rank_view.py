"""A rank's process seen from its node, for when its own sampler cannot answer.

Linux's ``/proc`` says whether the process is stopped (state ``T``: SIGSTOP, a debugger) and how
much CPU time its main thread used (a native call that holds the GIL may still be computing);
faulthandler, registered by the rank's sampler for ``SIGRTMIN`` +
:data:`~spark_torch.shared.stacks.DUMP_SIGNAL_OFFSET`, gives its true stack without the GIL (the signal
is only sent when ``/proc`` shows the rank catches it: a process that does not would die of it;
and only to a rank about to be stopped: :meth:`RankView.native_stack` with ``ask``).
The stacks of the processes a rank forked (a DataLoader's workers) are read here too.
"""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import time

import psutil

from spark_torch.shared.stacks import DUMP_SIGNAL_OFFSET, cut_tail
from spark_torch.shared.workdir_files import child_stack_pattern, native_dump_path

__all__ = ["RankView", "parse_dump", "with_source_lines"]

#: how often a rank that does not answer is asked again for its faulthandler stack
DUMP_EVERY_SECONDS = 5.0
#: a rank's descendants are looked for every this many rounds (a scan of every process in /proc,
#: ~10 ms; half a stall_timeout, or 5 s); the work of those found is read every round
DESCENDANTS_EVERY_ROUNDS = 5
#: the forked children shown with a rank, and how much of each
MAX_CHILDREN = 4
MAX_CHILD_CHARS = 4_000
_DUMP_FRAME = re.compile(r'^\s*File "(?P<file>.*)", line (?P<line>\d+) in (?P<name>.+)$')
_DUMP_THREAD = re.compile(r"^(Current thread|Thread) (?P<id>0x[0-9a-fA-F]+)")
_ENTRY = os.path.join("spark_torch", "rank", "")
_FRAME = re.compile(r'^File "(?P<file>.*)", line (?P<line>\d+), in (?P<name>.+)$')


def _stat_fields(path: str) -> list[str] | None:
    """A /proc ``stat`` file's fields after the command name (state first), or None."""
    try:
        with open(path, "rb") as fh:
            data = fh.read(4096).decode("ascii", "replace")
    except OSError:
        return None
    return data[data.rfind(")") + 2 :].split()


def _stat(pid: int) -> list[str] | None:
    """``/proc/<pid>/stat``'s fields after the command name (state first), or None."""
    return _stat_fields(f"/proc/{pid}/stat")


def _catches(pid: int, signum: int) -> bool:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def parse_dump(dump: str, thread: int) -> str:
    """The frames of ``thread`` in a faulthandler dump (most recent call first), innermost last
    and in the sampler's format, from the user's first frame on; ``""`` when it is not there."""
    blocks: dict[int, list[str]] = {}
    current: list[str] | None = None
    for line in dump.splitlines():
        head = _DUMP_THREAD.match(line)
        if head:
            current = blocks.setdefault(int(head["id"], 16), [])
            current.clear()
            continue
        frame = _DUMP_FRAME.match(line)
        if frame and current is not None:
            current.append(f'  File "{frame["file"]}", line {frame["line"]}, in {frame["name"]}\n')
    frames = list(reversed(blocks.get(thread) or (next(iter(blocks.values())) if len(blocks) == 1 else [])))
    entry = max((i for i, f in enumerate(frames) if _ENTRY in f and f.endswith(", in main\n")), default=-1)
    return "".join(frames[entry + 1 :])


def with_source_lines(text: str) -> str:
    """A stack text with each frame's source line (read from the file on this host, as the
    rank's sampler does; faulthandler prints none)."""
    lines: list[str] = []
    for line in text.splitlines(keepends=True):
        lines.append(line)
        match = _FRAME.match(line.strip())
        if match:
            source = _source_line(match["file"], int(match["line"]))
            if source:
                lines.append(f"    {source}\n")
    return "".join(lines)


def _source_line(filename: str, lineno: int) -> str:
    try:
        with open(filename, encoding="utf-8", errors="replace") as fh:
            for number, line in enumerate(fh, 1):
                if number == lineno:
                    return line.strip()
    except (OSError, ValueError):
        pass
    return ""


class RankView:
    """One rank's process (``pid``; 0: not started yet) from outside."""

    def __init__(self, pid: int = 0) -> None:
        self.pid = pid
        #: the process the node started (the rank's keeper, or the rank itself)
        self.started = pid
        #: the CPU seconds and bytes read of each descendant of the rank, at the last look
        self._descendants: dict[int, tuple[float, int]] = {}
        #: the rank's descendants as last scanned ({pid: its start time}), and when
        self._known: dict[int, str] = {}
        self._scanned = float("-inf")
        #: the main thread's id as faulthandler prints it (from the sampler's record)
        self.thread = 0
        self._cpu: float | None = None
        self._asked = 0.0
        self._native = ""

    def adopt(self, pid: int) -> None:
        """The rank's own pid, as its sampler wrote it. The process the node started may be the
        rank's keeper (:mod:`spark_torch.node.keeper`), whose child the rank is: its pid is
        taken only when it is that child (or the same process), so a record cannot point the
        node's signals anywhere else."""
        if pid <= 0 or pid == self.pid or not self.pid:
            return
        fields = _stat(pid)
        try:
            if fields is not None and int(fields[1]) == self.pid:
                self.pid = pid
        except (ValueError, IndexError):
            pass

    def returned(self) -> bool:
        """The rank itself ended while its keeper (the process the node started) still runs,
        stopping what the rank left: the rank is finished."""
        if not self.pid or self.pid == self.started:
            return False
        fields = _stat(self.pid)
        try:
            return fields is None or fields[0] in ("Z", "X") or int(fields[1]) != self.started
        except (ValueError, IndexError):
            return False

    def descendants_working(self, stack_file: str, interval: float) -> bool:
        """The processes the rank started (a child, a pool, a DataLoader worker that loads)
        used a tenth of ``interval`` (the node's round) in CPU seconds, or one of them read
        anything, since the last call (a new one: since it started). A forked child's own sampler thread (named in
        its stack
        file) is left out: it reads ``/proc`` and writes its file every interval."""
        samplers = _child_samplers(stack_file)
        now: dict[int, tuple[float, int]] = {}
        for pid, started in self._descendant_pids(DESCENDANTS_EVERY_ROUNDS * interval).items():
            fields = _stat(pid)
            work = _work(pid, samplers.get(pid, 0)) if fields is not None and fields[19:20] == [started] else None
            if work is not None:  # (a pid reused by another process since the scan is not the rank's)
                now[pid] = work
        before, self._descendants = self._descendants, now
        used = sum(cpu - before.get(pid, (0.0, 0))[0] for pid, (cpu, _) in now.items())
        reads = any(pid in before and chars != before[pid][1] for pid, (_, chars) in now.items())
        return used >= interval / 10 or reads

    def _descendant_pids(self, every: float) -> dict[int, str]:
        """The rank's descendants ({pid: start time}), scanned for at most every ``every``
        seconds (a new child's work counts from the next scan on)."""
        now = time.monotonic()
        if now - self._scanned >= every:
            self._scanned = now
            known: dict[int, str] = {}
            try:
                for child in psutil.Process(self.pid).children(recursive=True) if self.pid else []:
                    fields = _stat(child.pid)
                    if fields is not None and len(fields) > 19:
                        known[child.pid] = fields[19]
            except psutil.Error:
                pass
            self._known = known
        return self._known

    def stopped(self) -> bool:
        """The process is stopped (SIGSTOP, a debugger)."""
        fields = _stat(self.pid) if self.pid else None
        return bool(fields) and fields is not None and fields[0] in ("T", "t")

    def computing(self, threshold: float) -> bool:
        """Its main thread used ``threshold`` CPU seconds since the last call."""
        fields = _stat(self.pid) if self.pid else None
        try:
            main = _stat_of_task(self.pid) if fields else None
            cpu = (int(main[11]) + int(main[12])) / os.sysconf("SC_CLK_TCK") if main else None
        except (ValueError, IndexError, OSError):
            cpu = None
        before, self._cpu = self._cpu, cpu
        return cpu is not None and before is not None and cpu - before >= threshold

    def native_stack(self, stack_file: str, ask: bool) -> str:
        """The main thread's stack from faulthandler (with ``ask``, asked for at most every few
        seconds), or ``""`` when it could not be had."""
        path = native_dump_path(stack_file)
        try:
            with open(path, encoding="utf-8", errors="replace") as fh:
                dump = fh.read(256 * 1024)
        except OSError:
            dump = ""
        if dump:
            self._native = with_source_lines(parse_dump(dump, self.thread)) or self._native
        signum = int(signal.SIGRTMIN) + DUMP_SIGNAL_OFFSET
        now = time.monotonic()
        if ask and self.pid and now - self._asked >= DUMP_EVERY_SECONDS and _catches(self.pid, signum):
            self._asked = now
            try:
                os.truncate(path, 0)  # the rank appends: the file then holds one dump
                os.kill(self.pid, signum)
            except OSError:
                pass
        return self._native

    def children_stacks(self, stack_file: str) -> str:
        """The stacks of the live processes this rank forked that sample themselves."""
        blocks = []
        for path in sorted(glob.glob(child_stack_pattern(stack_file)))[: MAX_CHILDREN * 4]:
            try:
                pid = int(path.rsplit("-", 1)[1])
            except ValueError:
                continue
            fields = _stat(pid)
            if fields is None or fields[0] == "Z" or int(fields[1]) != self.pid:
                _remove(path)  # a child that is gone
                continue
            try:
                with open(path, encoding="utf-8") as fh:
                    stack = str(json.load(fh)["stack"])
            except (OSError, ValueError, KeyError, TypeError):
                continue
            blocks.append(
                f"  Process {pid} (forked by this rank: a DataLoader worker?):\n{cut_tail(stack, MAX_CHILD_CHARS)}"
            )
            if len(blocks) == MAX_CHILDREN:
                break
        return "".join("\n" + block for block in blocks)


def _child_samplers(stack_file: str) -> dict[int, int]:
    """{pid: its sampler thread's id} of the rank's forked children that sample themselves."""
    found: dict[int, int] = {}
    for path in glob.glob(child_stack_pattern(stack_file))[: MAX_CHILDREN * 4]:
        try:
            with open(path, encoding="utf-8") as fh:
                found[int(path.rsplit("-", 1)[1])] = int(json.load(fh).get("sampler", 0))
        except (OSError, ValueError, TypeError, AttributeError):
            continue
    return found


def _task_work(path: str) -> tuple[float, int] | None:
    """CPU seconds and bytes read of a process or thread (``/proc/<pid>`` or its ``task/<tid>``)."""
    fields = _stat_fields(f"{path}/stat")
    try:
        with open(f"{path}/io", "rb") as fh:
            io = dict(line.split(b":", 1) for line in fh.read(4096).splitlines() if b":" in line)
        if fields is None:
            return None
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), int(io[b"rchar"])
    except (OSError, KeyError, ValueError, IndexError):
        return None


def _work(pid: int, sampler: int) -> tuple[float, int] | None:
    """A descendant's CPU seconds and bytes read, without its sampler thread's."""
    total = _task_work(f"/proc/{pid}")
    own = _task_work(f"/proc/{pid}/task/{sampler}") if sampler else None
    if total is None or own is None:
        return total
    return total[0] - own[0], total[1] - own[1]


def _stat_of_task(pid: int) -> list[str] | None:
    """The main thread's own ``stat`` fields (its CPU time, not the whole process's), or None."""
    return _stat_fields(f"/proc/{pid}/task/{pid}/stat")


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
