"""Start rank processes in their own process group, pump their output, and kill them as a group."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import IO

__all__ = [
    "RankProcess",
    "spawn_rank",
    "kill_group",
    "reserve_port",
    "signal_name",
    "MAX_LINE_BYTES",
    "LinesCallback",
    "split_lines",
    "interrupts_deferred",
    "make_block",
    "block_lines",
    "last_lines",
]

#: longer lines are split into pieces of this many characters, each marked as continued
MAX_LINE_BYTES = 64 * 1024
CONTINUED = " [line continues]"
#: one pipe read takes up to this much
READ_BYTES = 64 * 1024
#: after a read that emptied the pipe, wait this long so a chatty rank's next lines arrive as
#: one batch (one read, one write, one flush on the driver) instead of one wake-up per line;
#: the first line of a burst is never delayed
COALESCE_SECONDS = 0.002

#: receives ``(rank, stream, block)``: complete lines of one rank's stdout or stderr, joined by
#: "\n" (no trailing newline). Handling a block with str methods (``replace``, ``rsplit``,
#: ``count``) costs next to nothing per line, unlike a Python loop over lines.
LinesCallback = Callable[[int, str, str], None]

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child before exec: get SIGKILL when the launching thread dies (Linux only)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the node runner's cleanup still applies
        pass


def signal_name(returncode: int | None) -> str | None:
    """``SIGKILL`` for a process killed by signal 9 (``returncode == -9``), else None."""
    if returncode is None or returncode >= 0:
        return None
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


@dataclass
class RankProcess:
    """One running rank: its process, identity, and the tail of its output."""

    rank: int
    local_rank: int
    popen: subprocess.Popen[bytes]
    started_at: float
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=40))
    pumps: list[threading.Thread] = field(default_factory=list)

    @property
    def pid(self) -> int:
        """The process id (also its process-group id)."""
        return self.popen.pid


def _without_carriage_returns(text: str) -> str:
    """``text`` with "\r\n" made "\n", including the last line's (whose "\n" was cut off)."""
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
    """``text`` (complete lines, no trailing newline) as a block: "\r\n" made "\n", lines
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


def _pump(stream: IO[bytes], proc: RankProcess, name: str, on_lines: LinesCallback) -> None:
    """Read one pipe until EOF and hand over complete lines as one block per read.

    A chatty rank costs one call of ``on_lines`` (and one ``flush()``, if it has that method) per
    read of up to 64 KiB instead of one per line; a quiet rank's line goes out at once.
    Incomplete UTF-8 sequences at a read boundary are kept for the next read.
    """
    flush = getattr(on_lines, "flush", None)
    fd = stream.fileno()
    pending = b""
    keep = proc.tail.maxlen or 40

    def deliver(block: str) -> None:
        proc.tail.extend(last_lines(block, keep))
        on_lines(proc.rank, name, block)
        if flush is not None:
            flush()

    with stream:
        while True:
            chunk = os.read(fd, READ_BYTES)
            if not chunk:
                break
            data = pending + chunk if pending else chunk
            cut = data.rfind(b"\n")
            pieces: list[str] = []
            if cut >= 0:
                pieces.append(make_block(data[:cut].decode("utf-8", errors="replace")))
                pending = data[cut + 1 :]
            else:
                pending = data
            while len(pending) > MAX_LINE_BYTES:  # a line without end yet: pass on what we have
                end = MAX_LINE_BYTES
                while end > MAX_LINE_BYTES - 3 and pending[end] & 0xC0 == 0x80:
                    end -= 1  # do not cut a UTF-8 sequence in two
                pieces.append(pending[:end].decode("utf-8", errors="replace") + CONTINUED)
                pending = pending[end:]
            if pieces:
                deliver("\n".join(pieces))
            if len(chunk) < READ_BYTES:
                time.sleep(COALESCE_SECONDS)
    if pending:
        deliver(make_block(pending.decode("utf-8", errors="replace")))


def spawn_rank(
    argv: Sequence[str],
    env: Mapping[str, str],
    *,
    rank: int,
    local_rank: int,
    cwd: str | None,
    on_lines: LinesCallback,
) -> RankProcess:
    """Start one rank in a new session (process group) that dies with its parent thread."""
    popen = subprocess.Popen(
        list(argv),
        env=dict(env),
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        preexec_fn=_die_with_parent,  # noqa: PLW1509 - only calls prctl
        close_fds=True,
    )
    proc = RankProcess(rank=rank, local_rank=local_rank, popen=popen, started_at=time.time())
    for stream, name in ((popen.stdout, "stdout"), (popen.stderr, "stderr")):
        assert stream is not None
        thread = threading.Thread(
            target=_pump, args=(stream, proc, name, on_lines), name=f"spark-torch-pump-{rank}-{name}", daemon=True
        )
        thread.start()
        proc.pumps.append(thread)
    return proc


@contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Hold Ctrl-C (SIGINT) back until the block is done, then raise KeyboardInterrupt.

    Used while a rank is being started, so an interrupt cannot land between the fork and the
    bookkeeping that lets the caller stop that rank again. Only in the main thread and only
    while Python's default SIGINT handler is installed; otherwise the block runs as is.
    """
    if threading.current_thread() is not threading.main_thread() or (
        signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    received: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, _frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if received:
        raise KeyboardInterrupt


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def kill_group(procs: Sequence[RankProcess], grace: float = 5.0) -> None:
    """SIGTERM every rank's process group, wait up to ``grace`` seconds, then SIGKILL and reap.

    The group is signalled even after its leader exited, so grandchildren (data loader
    workers, a script's subprocesses) go too.
    """
    for proc in procs:
        _signal_group(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for proc in procs:
        remaining = max(0.0, deadline - time.monotonic())
        try:
            proc.popen.wait(timeout=remaining)
        except subprocess.TimeoutExpired:
            pass
    for proc in procs:
        _signal_group(proc.pid, signal.SIGKILL)
        proc.popen.wait()


def reserve_port(host: str) -> socket.socket:
    """Bind (without listening) a free port on ``host`` and keep it reserved.

    The socket has SO_REUSEADDR, so torch's TCPStore on rank 0 (which sets it too) can bind
    and listen on the same port while the reservation keeps every other program off it. Close
    the returned socket when the run ends.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, 0))
    except OSError:
        sock.close()
        raise
    return sock
