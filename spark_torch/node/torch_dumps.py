"""The dump torch's NCCL watchdog leaves for a failed rank, found so that the error can name it.

With ``TORCH_NCCL_DUMP_ON_TIMEOUT=1``, a collective that times out makes torch write the rank's
Flight Recorder to ``TORCH_FR_DUMP_TEMP_FILE`` (older name ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``;
default ``/tmp/nccl_trace_rank_``) followed by the global rank, then end the process. The rank
dies of a signal with nothing raised in Python, so without this the user learns neither that a
dump exists nor where. Only a regular file written since the rank started counts (a stale dump
of an earlier run on the same host is not this rank's).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping

__all__ = ["PREFIX_VARIABLES", "DEFAULT_PREFIX", "watchdog_dump", "watchdog_dumps"]

#: where torch reads the dump's path prefix, newest name first
PREFIX_VARIABLES = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
#: torch's prefix when neither variable is set
DEFAULT_PREFIX = "/tmp/nccl_trace_rank_"
#: clock slack between the rank's start (taken here) and the file's time (taken by the kernel)
_SLACK_SECONDS = 2.0


def _dumps_on_timeout(env: Mapping[str, str]) -> bool:
    return env.get("TORCH_NCCL_DUMP_ON_TIMEOUT", "").strip().lower() in ("1", "true", "yes", "y")


def watchdog_dump(env: Mapping[str, str], rank: int, started_at: float) -> str | None:
    """The path of the dump torch wrote for global ``rank`` after ``started_at`` (``time.time()``),
    under the rank's environment ``env``; None when there is none. The default prefix is looked at
    only when ``env`` turns the dump on (the prefix variables name a place only a run that asked
    for dumps writes to)."""
    prefix = next((env[name] for name in PREFIX_VARIABLES if env.get(name)), None)
    if prefix is None:
        if not _dumps_on_timeout(env):
            return None
        prefix = DEFAULT_PREFIX
    path = f"{prefix}{rank}"
    try:
        info = os.stat(path)
    except OSError:
        return None
    if not stat.S_ISREG(info.st_mode) or info.st_mtime < started_at - _SLACK_SECONDS:
        return None
    return path


def watchdog_dumps(env: Mapping[str, str], rank: int, started_at: float) -> tuple[str, ...]:
    """:func:`watchdog_dump` as the tuple a failure or a stopped rank carries (empty: none)."""
    dump = watchdog_dump(env, rank, started_at)
    return (dump,) if dump is not None else ()
