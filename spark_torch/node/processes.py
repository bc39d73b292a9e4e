"""Start rank processes in their own process group, pump their output, and kill them as a group."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import IO, Any

import psutil

from spark_torch.base import envnames
from spark_torch.node.keeper import KEEPER_MODULE
from spark_torch.node.process_tree import create_time, terminate_trees
from spark_torch.node.template.client import WarmProcess, warm_spawn
from spark_torch.shared.lines import CONTINUED, MAX_LINE_BYTES, RankOutput, last_lines, make_block

__all__ = [
    "RankProcess",
    "spawn_rank",
    "kill_group",
    "reserve_port",
    "signal_name",
    "interrupts_deferred",
    "with_package_on_path",
]

logger = logging.getLogger(__name__)

#: after SIGKILL, how long to wait for a rank to be reaped before reporting it stuck
REAP_SECONDS = 5.0
#: one pipe read takes up to this much
READ_BYTES = 64 * 1024
#: after a read that emptied the pipe, wait this long so a chatty rank's next lines arrive as
#: one batch (one read, one write, one flush on the driver) instead of one wake-up per line;
#: the first line of a burst is never delayed
COALESCE_SECONDS = 0.002


#: where this process found spark_torch, made absolute at import: a Python worker that imported it by
#: a relative path may later run in a current directory that is gone (its executor's, after a loss)
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def with_package_on_path(env: dict[str, str]) -> dict[str, str]:
    """Children run ``python -m spark_torch.…`` from wherever this process found spark_torch."""
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH", "")) if p)
    return env


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
    #: a ``subprocess.Popen``, or a :class:`~spark_torch.node.template.client.WarmProcess` (pid, poll, wait)
    popen: Any
    started_at: float
    #: psutil's creation time of the process: a stale pid is never signalled
    created: float = 0.0
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=40))
    pumps: list[threading.Thread] = field(default_factory=list)

    @property
    def pid(self) -> int:
        """The process id (also its process-group id)."""
        return int(self.popen.pid)


def _pump(stream: IO[bytes], proc: RankProcess, name: str, on_lines: RankOutput) -> None:
    """Read one pipe until EOF and hand over complete lines as one block per read.

    A chatty rank costs one call of ``on_lines`` (and one ``flush()``) per read of up to 64 KiB
    instead of one per line; a quiet rank's line goes out at once. Incomplete UTF-8 sequences at
    a read boundary are kept for the next read.
    """
    fd = stream.fileno()
    pending = b""
    keep = proc.tail.maxlen or 40

    def deliver(block: str) -> None:
        proc.tail.extend(last_lines(block, keep))
        on_lines(proc.rank, name, block)
        on_lines.flush()

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


def _warm_start(
    argv: Sequence[str], env: Mapping[str, str], cwd: str | None, pass_fds: Sequence[int], idle: float | None
) -> tuple[WarmProcess, tuple[IO[bytes], IO[bytes]]] | None:
    """Fork the rank from the warm-start template (torch already imported), or None (cold)."""
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    null = os.open(os.devnull, os.O_RDONLY)
    try:
        process = warm_spawn(argv[0], argv, env, cwd, [null, out_w, err_w, *pass_fds], idle=idle)
    finally:
        for fd in (out_w, err_w, null):
            os.close(fd)
    if process is None:
        os.close(out_r)
        os.close(err_r)
        return None
    return process, (os.fdopen(out_r, "rb", buffering=0), os.fdopen(err_r, "rb", buffering=0))


def _kept(argv: Sequence[str]) -> list[str]:
    """``python -m MODULE ARGS`` as ``python -m spark_torch.node.keeper MODULE ARGS``: the rank
    runs under its keeper, a child subreaper nothing the rank starts can escape."""
    if list(argv[1:2]) == ["-m"]:
        return [argv[0], "-m", KEEPER_MODULE, *argv[2:]]
    return list(argv)


def spawn_rank(
    argv: Sequence[str],
    env: Mapping[str, str],
    *,
    rank: int,
    local_rank: int,
    cwd: str | None,
    on_lines: RankOutput,
    pass_fds: Sequence[int] = (),
    warm: bool = True,
    warm_idle: float | None = None,
) -> RankProcess:
    """Start one rank in a new session (its own process group).

    Forked from the warm-start template when ``warm`` and it can be (:mod:`spark_torch.node.template.client`:
    torch is already imported there; a template this call starts ends after ``warm_idle``
    seconds with no rank running, the run's ``warm_start_idle``), else a fresh interpreter; either
    way under its keeper (:mod:`spark_torch.node.keeper`). No ``preexec_fn`` (Python code between
    fork and exec can deadlock a multi-threaded parent): the rank arms its own parent-death
    signal first thing (:mod:`spark_torch.rank.deathsig`), told who its parent is by
    ``SPARK_TORCH_PARENT_PID``.
    """
    streams: tuple[IO[bytes], IO[bytes]]
    popen: Any = _warm_start(argv, env, cwd, pass_fds, warm_idle) if warm else None
    if popen is not None:
        popen, streams = popen
    else:
        popen = subprocess.Popen(
            _kept(argv),
            env={**env, envnames.PARENT_PID: str(os.getpid())},
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            close_fds=True,
            pass_fds=tuple(pass_fds),
        )
        assert popen.stdout is not None and popen.stderr is not None
        streams = (popen.stdout, popen.stderr)
    proc = RankProcess(
        rank=rank, local_rank=local_rank, popen=popen, started_at=time.time(), created=create_time(popen.pid)
    )
    for stream, name in zip(streams, ("stdout", "stderr")):
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


def kill_group(procs: Sequence[RankProcess], grace: float = 5.0, marker: Mapping[str, str] | None = None) -> None:
    """Stop every rank's process tree: SIGTERM, up to ``grace`` seconds, SIGKILL (see
    :mod:`spark_torch.node.process_tree`), then reap each rank, bounded.

    ``marker``: environment items every process of this node inherits (see
    :func:`spark_torch.node.workdir.node_marker`), which finds descendants that left the rank's process group or were
    orphaned by its exit.
    """
    left = terminate_trees([(p.pid, p.created) for p in procs], grace, marker=marker)
    for proc in procs:
        try:
            proc.popen.wait(timeout=REAP_SECONDS)
        except subprocess.TimeoutExpired:
            left.append(psutil.Process(proc.pid))
    if left:
        logger.warning(
            "spark_torch: %d process(es) did not exit after SIGKILL (stuck in the kernel?): %s",
            len(left),
            ", ".join(str(p.pid) for p in left),
        )


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
