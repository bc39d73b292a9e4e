"""Where rank output goes on the driver: prefixed lines on the driver's sys.stdout/sys.stderr.

Lines are written through ``sys.stdout``/``sys.stderr`` (not file descriptors 1/2) so that in
Jupyter they appear under the cell that called ``run()``; they are flushed after each batch
(one pipe read of a rank, or one frame from a node), and a batch is written with one call, so output stays live.
"""

from __future__ import annotations

import os
import sys
import threading
from collections import deque
from typing import IO

from spark_torch.base import envnames
from spark_torch.base.states import RankState
from spark_torch.driver.config import DistributorConfig
from spark_torch.driver.console.status import RunStatus
from spark_torch.errors import ConfigurationError
from spark_torch.shared.lines import block_lines, last_lines
from spark_torch.shared.owned_files import UnsafePathError, open_own_file

__all__ = ["DriverLogSink", "format_line", "replica_group_of", "TAIL_LINES"]

#: lines of each rank kept on the driver for error messages
TAIL_LINES = 20


def _open_log(log_dir: str, rank: int) -> IO[str]:
    """``log_dir/rank-N.log`` for appending, owner-only (logs may hold data or credentials a
    rank printed). Only a regular file of this user with no other name: never through a
    symbolic link, never someone else's file, never a hard link to a file elsewhere (a link
    planted in a shared ``log_dir`` must not redirect the log into, or chmod, a victim's file),
    and never a FIFO (opened non-blocking, it cannot stop the driver before anything starts)."""
    path = os.path.join(log_dir, f"rank-{rank}.log")
    try:
        fd = open_own_file(path, append=True)
    except UnsafePathError as exc:
        raise ConfigurationError(f"log_dir: {path} {exc.reason}; remove it or choose another log_dir") from None
    return os.fdopen(fd, "a", encoding="utf-8")


def format_line(rank: int, text: str, group: int | None = None) -> str:
    """``[rank 1] text``; in a replica group's run, ``[group 0 rank 1] text``."""
    return f"[rank {rank}] {text}" if group is None else f"[group {group} rank {rank}] {text}"


def replica_group_of(config: DistributorConfig) -> int | None:
    """The replica group whose run ``config`` is (its variables are in ``env``), else None."""
    group = config.env.get(envnames.REPLICA_GROUP_ID, "")
    return int(group) if group.isdigit() and envnames.NUM_REPLICA_GROUPS in config.env else None


class DriverLogSink:
    """Prints the ranks' lines that ``log_ranks`` selects and keeps per-rank files in ``log_dir``."""

    def __init__(self, config: DistributorConfig, world_size: int = 0) -> None:
        self._config = config
        self._group = replica_group_of(config)
        self._lock = threading.Lock()
        self._files: dict[int, IO[str]] = {}
        self.tails: dict[int, deque[str]] = {}
        self.lines = 0
        #: the live status of the current attempt (disabled unless shown; :meth:`begin_attempt`)
        self.status = RunStatus(0, enabled=False)
        if config.log_dir is not None:
            os.makedirs(config.log_dir, exist_ok=True)
            try:  # every rank's file now: a problem with one is an error before anything starts
                for rank in range(world_size):
                    self._files[rank] = _open_log(config.log_dir, rank)
            except BaseException:
                self.close()
                raise

    def __call__(self, rank: int, stream: str, block: str) -> None:
        """Receive a block of complete lines (joined by "\n") of one rank's stdout or stderr."""
        with self._lock:
            self.lines += block_lines(block)
            tail = self.tails.get(rank)
            if tail is None:
                tail = self.tails[rank] = deque(maxlen=TAIL_LINES)
            tail.extend(last_lines(block, TAIL_LINES))
            if self._config.shows_rank(rank):
                out = sys.stderr if stream == "stderr" else sys.stdout
                prefix = format_line(rank, "", self._group)
                text = prefix + block.replace("\n", "\n" + prefix) + "\n"
                if self.status.enabled:
                    with self.status.around_output():
                        out.write(text)
                        out.flush()
                else:
                    out.write(text)
            if self._config.log_dir is not None and rank >= 0:
                fh = self._files.get(rank)
                if fh is None:
                    fh = self._files[rank] = _open_log(self._config.log_dir, rank)
                fh.write(block + "\n")

    def begin_attempt(self, world_size: int, show: bool) -> RunStatus:
        """The live status of a new attempt of ``world_size`` ranks (shown when ``show``); the
        previous attempt's status line is closed."""
        self.status.close()
        self.status = RunStatus(world_size, enabled=show)
        return self.status

    def rank_event(self, rank: int, state: RankState) -> None:
        """A rank ``started``, ``finished`` or ``failed`` (feeds the live status)."""
        self.status.event(rank, state)

    def flush(self) -> None:
        """Flush what was written; called after each batch of lines (a pipe read, a frame)."""
        with self._lock:
            for out in (sys.stdout, sys.stderr):
                out.flush()
            for fh in self._files.values():
                fh.flush()

    def tail(self, rank: int) -> tuple[str, ...]:
        """The last lines this driver received from ``rank``."""
        with self._lock:
            return tuple(self.tails.get(rank, ()))

    def close(self) -> None:
        """Close the status line and the per-rank files."""
        self.status.close()
        with self._lock:
            for fh in self._files.values():
                fh.close()
            self._files.clear()
