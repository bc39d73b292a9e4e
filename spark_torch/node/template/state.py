"""What the warm-start template keeps per forked child and per connection, and its two
primitives for them: one line to its stderr, and a SIGKILL for a child's whole group."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import time

__all__ = ["Rank", "Client", "log", "kill_group"]


class Rank:
    """One forked child (a rank or a store host) until it is reaped."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.pidfd: int | None = None  # readable once the child exited
        self.go: int | None = None  # the write end the child waits on before it becomes the rank
        self.client: Client | None = None
        self.idle: float | None = None  # its request's idle time, counted from its exit


class Client:
    """One node runner's connection: first its request, then its rank's lifetime."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn = conn
        self.since = time.monotonic()
        self.rank: Rank | None = None
        self.closed = False


def log(message: str) -> None:
    """One line to the template's stderr; a broken stderr must not end the template."""
    with contextlib.suppress(Exception):
        print(f"spark_torch template {os.getpid()}: {message}", file=sys.stderr, flush=True)


def kill_group(pid: int) -> None:
    """SIGKILL a child and its process group (it may not have called setsid() yet). Safe
    against pid reuse: an unreaped child keeps its pid, and so the group id, taken."""
    for send in (os.killpg, os.kill):
        with contextlib.suppress(OSError):
            send(pid, signal.SIGKILL)
