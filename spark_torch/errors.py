"""The exceptions spark_torch raises.

Every exception has one root, :class:`SparkTorchError`, and also subclasses the nearest
builtin, so ``except ValueError`` / ``except RuntimeError`` clauses written for PySpark's
TorchDistributor keep working::

    SparkTorchError
    ├── ConfigurationError (ValueError)      bad arguments or Spark configuration
    │   ├── InsufficientSlotsError            the cluster cannot run all tasks at once
    │   └── ClusterConfigurationError (+ RuntimeError)  GPU resources / encryption settings
    ├── PicklingError (TypeError)             the function or its arguments do not pickle
    ├── ArgumentError (TypeError)             the arguments do not fit the function's signature
    ├── LaunchError (RuntimeError)            ranks could not be started
    └── DistributedRunError (RuntimeError)    a rank failed; names the rank, host, cause
        ├── RunTimeoutError (+ TimeoutError)  the run exceeded ``timeout``
        ├── RunStalledError                   no rank made progress for ``stall_timeout``
        └── ReplicaGroupError                 a replica group failed past its ``max_restarts``

All of them pickle (they cross process boundaries between ranks, executors and driver).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "SparkTorchError",
    "ConfigurationError",
    "InsufficientSlotsError",
    "ClusterConfigurationError",
    "PicklingError",
    "ArgumentError",
    "LaunchError",
    "DistributedRunError",
    "RunTimeoutError",
    "RunStalledError",
    "ReplicaGroupError",
    "RankFailure",
    "StoppedRank",
]


class SparkTorchError(Exception):
    """Root of every exception raised by spark_torch."""


class ConfigurationError(SparkTorchError, ValueError):
    """An argument or a Spark setting makes the run impossible; the message says how to fix it."""


class InsufficientSlotsError(ConfigurationError):
    """The cluster has fewer free task slots than the barrier stage needs."""


class ClusterConfigurationError(ConfigurationError, RuntimeError):
    """A Spark setting (GPU resources, encryption) makes the run impossible.

    Also a ``RuntimeError``, which is what TorchDistributor raises for these settings.
    """


class PicklingError(SparkTorchError, TypeError):
    """The training function or one of its arguments cannot be sent to the ranks."""


class ArgumentError(SparkTorchError, TypeError):
    """The arguments given to ``run()`` do not fit the training function's signature (found on
    the driver, before any rank starts)."""


class LaunchError(SparkTorchError, RuntimeError):
    """The ranks could not be started (missing script on an executor, interpreter mismatch...)."""


@dataclass(frozen=True)
class RankFailure:
    """What is known about one failed rank: plain text only, so it travels anywhere."""

    rank: int
    host: str
    exit_code: int | None = None
    signal_name: str | None = None
    exc_type: str | None = None
    exc_message: str | None = None
    traceback: str | None = None
    last_lines: tuple[str, ...] = field(default_factory=tuple)
    started_at: float = 0.0
    failed_at: float = 0.0
    #: files torch wrote about this rank's failure on its host (the NCCL watchdog's Flight
    #: Recorder dump, ``TORCH_NCCL_DUMP_ON_TIMEOUT``)
    dumps: tuple[str, ...] = field(default_factory=tuple)

    def cause(self) -> str:
        """One line: the remote exception, or the exit code / signal of the process (and what
        else is known, for a rank that raised nothing)."""
        if self.exc_type:
            return f"{self.exc_type}: {self.exc_message}" if self.exc_message else self.exc_type
        if self.signal_name:
            how = f"killed by {self.signal_name}"
        elif self.exit_code is not None:
            how = f"exited with code {self.exit_code}"
        else:
            how = "failed for an unknown reason"
        return f"{how}: {self.exc_message}" if self.exc_message else how

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {
            "rank": self.rank,
            "host": self.host,
            "exit_code": self.exit_code,
            "signal_name": self.signal_name,
            "exc_type": self.exc_type,
            "exc_message": self.exc_message,
            "traceback": self.traceback,
            "last_lines": list(self.last_lines),
            "started_at": self.started_at,
            "failed_at": self.failed_at,
            "dumps": list(self.dumps),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RankFailure:
        """Inverse of :meth:`to_dict`; ignores unknown keys."""
        return cls(
            rank=int(data["rank"]),
            host=str(data.get("host", "?")),
            exit_code=data.get("exit_code"),
            signal_name=data.get("signal_name"),
            exc_type=data.get("exc_type"),
            exc_message=data.get("exc_message"),
            traceback=data.get("traceback"),
            last_lines=tuple(str(x) for x in data.get("last_lines") or ()),
            started_at=float(data.get("started_at") or 0.0),
            failed_at=float(data.get("failed_at") or 0.0),
            dumps=tuple(str(x) for x in data.get("dumps") or ()),
        )


@dataclass(frozen=True)
class StoppedRank:
    """A rank that spark_torch stopped while it still ran (the run's ``timeout`` passed): no
    failure of its own, only where it ran and what it printed last."""

    rank: int
    #: its host, when the driver knows it (None: a node that could not say)
    host: str | None = None
    last_lines: tuple[str, ...] = field(default_factory=tuple)
    #: files torch wrote about it on its host (a NCCL watchdog's dump of a rank that then hung)
    dumps: tuple[str, ...] = field(default_factory=tuple)


def _format_stopped(stopped: tuple[StoppedRank, ...]) -> list[str]:
    """The stopped ranks: the last lines of the first that printed any, and who else was stopped."""
    if not stopped:
        return []
    shown = next((s for s in stopped if s.last_lines), None)
    lines: list[str] = []
    if shown is not None:
        where = f" on {shown.host}" if shown.host else ""
        lines += ["", f"Last {len(shown.last_lines)} lines of rank {shown.rank}'s output{where}:"]
        lines += [f"  {line}" for line in shown.last_lines]
    ranks = ", ".join(str(s.rank) for s in stopped)
    lines += ["", f"Stopped while still running: {'rank' if len(stopped) == 1 else 'ranks'} {ranks}"]
    for rank in stopped:
        lines += _dump_lines(rank.rank, rank.host, rank.dumps)
    return lines


def _dump_lines(rank: int, host: str | None, dumps: tuple[str, ...]) -> list[str]:
    """Where torch's dumps of ``rank`` are and how to read them (none: no lines)."""
    lines: list[str] = []
    for dump in dumps:
        folder, name = os.path.split(dump)
        prefix = name[: -len(str(rank))] if name.endswith(str(rank)) else name
        where = f"is on {host}" if host else "is on its host"
        lines += [
            "",
            f"torch's NCCL watchdog dump of rank {rank} (its Flight Recorder) {where}: {dump}",
            f"  read it with: torchfrtrace {folder or '.'} --prefix {prefix} --allow-incomplete-ranks",
        ]
    return lines


def _format_failures(failures: tuple[RankFailure, ...], headline: str | None) -> str:
    """Root cause first (the earliest failing rank), then the other ranks grouped by cause."""
    if not failures:
        return headline or "the distributed run failed"
    ordered = sorted(failures, key=lambda f: (f.failed_at or float("inf"), f.rank))
    root = ordered[0]
    lines = [headline or f"rank {root.rank} on {root.host} failed: {root.cause()}"]
    if root.traceback:
        lines += ["", f"Traceback from rank {root.rank}:", root.traceback.rstrip()]
    if root.last_lines:
        lines += ["", f"Last {len(root.last_lines)} lines of rank {root.rank}'s output:"]
        lines += [f"  {line}" for line in root.last_lines]
    lines += _dump_lines(root.rank, root.host, root.dumps)
    others: dict[str, list[int]] = {}
    for failure in ordered[1:]:
        others.setdefault(failure.cause(), []).append(failure.rank)
    if others:
        lines += ["", "Other ranks:"]
        for cause, ranks in others.items():
            who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, sorted(ranks)))}"
            lines.append(f"  {who}: {cause}")
    return "\n".join(lines)


class DistributedRunError(SparkTorchError, RuntimeError):
    """A rank failed. The message starts with the failing rank, its host and the cause.

    ``failures`` holds one :class:`RankFailure` per failed rank, root cause first; ``stopped``
    the ranks spark_torch stopped while they still ran (a timeout), which did not fail.
    """

    def __init__(
        self,
        failures: tuple[RankFailure, ...] | list[RankFailure],
        headline: str | None = None,
        stacks: dict[int, str] | None = None,
        stacks_text: str | None = None,
        stopped: tuple[StoppedRank, ...] | list[StoppedRank] = (),
    ):
        self.failures = tuple(sorted(failures, key=lambda f: (f.failed_at or float("inf"), f.rank)))
        self.headline = headline
        #: the ranks that were stopped while still running (a timeout), in rank order
        self.stopped: tuple[StoppedRank, ...] = tuple(sorted(stopped, key=lambda s: s.rank))
        #: each rank's Python stack when the ranks were stopped (timeout, stall, interruption):
        #: ``{rank: text}``, innermost call last; empty when none was taken
        self.stacks: dict[int, str] = dict(stacks or {})
        #: the same stacks with ranks of the same stack grouped, as the message shows them
        self.stacks_text = stacks_text
        message = "\n".join([_format_failures(self.failures, headline), *_format_stopped(self.stopped)])
        if stacks_text:
            message += "\n\nWhere each rank was:\n" + stacks_text
        super().__init__(message)

    @property
    def rank(self) -> int | None:
        """The rank that failed first, if known."""
        return self.failures[0].rank if self.failures else None

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.failures, self.headline, self.stacks, self.stacks_text, self.stopped))


class ReplicaGroupError(DistributedRunError):
    """With ``replica_groups``: replica group ``group`` failed more times than its
    ``max_restarts`` budget; ``failures`` and ``stacks`` are those of its last attempt, and the
    message leads with the group."""

    def __init__(
        self,
        group: int,
        failures: tuple[RankFailure, ...] | list[RankFailure],
        headline: str | None = None,
        stacks: dict[int, str] | None = None,
        stacks_text: str | None = None,
        stopped: tuple[StoppedRank, ...] | list[StoppedRank] = (),
    ):
        self.group = group
        super().__init__(failures, headline, stacks, stacks_text, stopped)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.group, self.failures, self.headline, self.stacks, self.stacks_text, self.stopped))


class RunTimeoutError(DistributedRunError, TimeoutError):
    """The run took longer than ``timeout``; every rank was stopped. ``stopped`` names the ranks
    that were still running (with their last lines), ``stacks`` where each was just before."""


class RunStalledError(DistributedRunError):
    """No rank made progress for ``stall_timeout`` seconds and ``stall_action="fail"``: the
    attempt was stopped. The message and ``stacks`` ({rank: text}) say where each rank was."""
