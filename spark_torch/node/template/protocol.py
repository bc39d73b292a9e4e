"""What a node runner and the warm-start template agree on: the request, its limits, and which
settings of a rank's environment a fork cannot change (so templates are keyed by them).

Used by both ends: :mod:`spark_torch.node.template.client` (the runner, the client) and
:mod:`spark_torch.node.template.server` (the template, the server). Standard library and
spark_torch's leaf modules only.

The protocol: one JSON message per packet on a ``SOCK_SEQPACKET`` connection. The request is
``{"argv", "env", "cwd", "umask", "rlimits", "idle"}`` with its descriptors
(``socket.send_fds``); the answers are ``{"pid": N}`` or ``{"error": TEXT}`` (no rank: start it
cold), and later ``{"exit": CODE}`` (negative: killed by that signal).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform
import resource
import signal
from collections.abc import Mapping
from typing import Any

from spark_torch.base import envnames
from spark_torch.base.envnames import SCRUBBED
from spark_torch.settings import WARM_START_IDLE_MAX

__all__ = [
    "THREAD_ENV",
    "MAX_REQUEST",
    "MAX_FDS",
    "RLIMITS",
    "STARTUP_PREFIXES",
    "STARTUP_NAMES",
    "MARK_SLOT_VALUE",
    "check_request",
    "clamp_idle",
    "startup_env",
    "runner_limits",
    "runner_umask",
    "runner_affinity",
    "runner_priority",
    "runner_ignored_signals",
    "cold_reason",
]

#: the template's own thread pools: one thread each, so that it has no thread to lose in fork()
THREAD_ENV = {name: "1" for name in (*envnames.THREAD_VARS, *envnames.IMPORT_SIZED_THREAD_VARS)}
MAX_REQUEST = 4 << 20
#: at most this many file descriptors per request (stdin, stdout, stderr, two report pipes)
MAX_FDS = 8


def _platform_rlimits() -> tuple[str, ...]:
    """Every ``RLIMIT_*`` this platform has, one name per limit (``OFILE`` is ``NOFILE``)."""
    names: dict[int, str] = {}
    for attr in sorted(dir(resource)):
        if attr.startswith("RLIMIT_"):
            names.setdefault(getattr(resource, attr), attr[len("RLIMIT_") :])
    return tuple(names.values())


#: the resource limits a rank gets from its node runner: all of them, as a cold rank inherits them
RLIMITS = _platform_rlimits()
#: The template runs with :data:`~spark_torch.base.envnames.MARK_SLOT` set to this, last in its environment:
#: room in its environment block (what /proc/PID/environ shows, for every fork of it too) that
#: each child overwrites with its node's marker (:data:`~spark_torch.base.envnames.NODE_MARKER`), so
#: that a warm rank's forked descendants are found as a cold rank's are
#: (:func:`spark_torch.node.process_tree.find_marked`)
MARK_SLOT_VALUE = "-" * 256
#: Environment read when an interpreter starts or torch is imported, which a fork cannot change
#: afterwards: Python's own (PYTHONHASHSEED, PYTHONWARNINGS, PYTHONMALLOC, PYTHONOPTIMIZE,
#: PYTHONPATH, ...), the dynamic loader's (LD_PRELOAD, LD_LIBRARY_PATH), glibc malloc's and
#: other allocators', the locale and time zone, torch's (TORCH_LOGS and friends, read at
#: import) and the OpenMP/MKL runtimes' (read when torch loads them). Templates are keyed by
#: these variables of the rank's environment and started with them.
STARTUP_PREFIXES = (
    "PYTHON",
    "LD_",
    "MALLOC_",
    "GLIBC_TUNABLES",
    "TCMALLOC_",
    "JEMALLOC_",
    "LC_",
    "LANG",
    "TZ",
    "TORCH_",
    "PYTORCH_",
    "OMP_",
    "KMP_",
    "GOMP_",
    "MKL_",
)
#: ... and these whole names: ``HOME`` places the user site directory (``site.USER_SITE``,
#: on ``sys.path`` outside a virtual environment), which ``site`` sets when the interpreter starts
STARTUP_NAMES = ("HOME",)
#: ... except what the fork handles per rank or what is read later, in the rank: the thread
#: counts (the template runs single-threaded, each child sizes torch's pool) and NCCL's
#: settings (read when a NCCL group is created; the template never touches CUDA) and the Flight
#: Recorder's (read when a rank creates its first process group)
STARTUP_EXEMPT = (*THREAD_ENV, "TORCH_NCCL_", "TORCH_FR_")
#: thread counts a fork cannot give a rank: numpy's OpenBLAS pool is sized when numpy is
#: imported (in the template, single-threaded); a rank that asks for more starts cold
COLD_IF_NOT_ONE = envnames.IMPORT_SIZED_THREAD_VARS


def startup_env(env: Mapping[str, str]) -> dict[str, str]:
    """The variables of ``env`` that an interpreter reads at start-up (:data:`STARTUP_PREFIXES`,
    :data:`STARTUP_NAMES`)."""
    return {
        k: v
        for k, v in env.items()
        if (k in STARTUP_NAMES or k.startswith(STARTUP_PREFIXES) and not k.startswith(STARTUP_EXEMPT))
        and k not in SCRUBBED
    }


def runner_limits() -> dict[str, list[int]]:
    """This process's resource limits (every one the platform has), as a cold rank would inherit them."""
    limits = {}
    for name in RLIMITS:
        try:
            limits[name] = list(resource.getrlimit(getattr(resource, f"RLIMIT_{name}")))
        except (OSError, ValueError):  # a limit the running kernel does not know
            continue
    return limits


def runner_umask() -> int:
    """This process's umask, read without changing it (another thread may be creating files)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def runner_ignored_signals() -> list[int]:
    """The signals this process ignores (``SIG_IGN``), as a cold rank would inherit them (an exec
    keeps an ignored signal ignored and resets a handled one). Templates are keyed by them: a
    template keeps those it started with, and a driver may ignore another set later (a background
    job ignores SIGINT until a SparkContext installs its handler)."""
    ignored = []
    for sig in signal.valid_signals():
        try:
            if signal.getsignal(sig) is signal.SIG_IGN:
                ignored.append(int(sig))
        except (OSError, ValueError):  # one the interpreter does not manage
            continue
    return sorted(ignored)


def runner_affinity() -> list[int] | None:
    """The CPUs this process may run on, as a cold rank would inherit them (None: unknown)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def runner_priority() -> dict[str, int]:
    """This thread's nice value, ``oom_score_adj``, scheduling policy (and its static priority)
    and I/O class and level, as a cold rank would inherit them. Templates are keyed by them (a
    template starts with its runner's, and forks from its only thread): a child could raise
    some of them, but lowering a nice value or leaving SCHED_IDLE takes a privilege the template
    may not have."""
    found = {"nice": os.getpriority(os.PRIO_PROCESS, 0)}
    try:
        with open("/proc/self/oom_score_adj") as fh:
            found["oom_score_adj"] = int(fh.read().strip())
    except (OSError, ValueError):
        pass
    with contextlib.suppress(AttributeError, OSError):
        found["sched_policy"] = os.sched_getscheduler(0)
        found["sched_priority"] = os.sched_getparam(0).sched_priority
    ioprio = _ioprio()
    if ioprio is not None:
        found["ioprio"] = ioprio
    return found


#: ioprio_get(2)'s system call number, per machine (no wrapper in glibc or Python)
_IOPRIO_GET = {"x86_64": 252, "aarch64": 31, "ppc64le": 274, "s390x": 283}


def _ioprio() -> int | None:
    """This thread's I/O class and level (ioprio_get(IOPRIO_WHO_PROCESS, 0)); None: unknown."""
    number = _IOPRIO_GET.get(platform.machine())
    if number is None:
        return None
    try:
        value = int(ctypes.CDLL(None, use_errno=True).syscall(number, 1, 0))
    except (OSError, AttributeError):
        return None
    return value if value >= 0 else None


def check_request(request: Any, fds: list[int]) -> dict[str, Any]:
    """The request, or ValueError naming what is wrong with it."""
    if not isinstance(request, dict) or len(fds) < 3:
        raise ValueError("a request is a JSON object with argv/env/cwd and at least 3 descriptors")
    argv, env = request.get("argv"), request.get("env")
    if not (isinstance(argv, list) and argv and all(isinstance(a, str) for a in argv)):
        raise ValueError("argv must be a non-empty list of strings")
    if not (isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
        raise ValueError("env must map strings to strings")
    if not isinstance(request.get("cwd"), (str, type(None))) or not isinstance(request.get("umask"), (int, type(None))):
        raise ValueError("cwd must be a string and umask an integer")
    limits = request.get("rlimits", {})
    if not isinstance(limits, dict) or any(
        name not in RLIMITS or not (isinstance(v, list) and len(v) == 2 and all(isinstance(x, int) for x in v))
        for name, v in limits.items()
    ):
        raise ValueError(f"rlimits must map names of {RLIMITS} to [soft, hard]")
    cpus = request.get("affinity")
    if cpus is not None and not (
        isinstance(cpus, list) and cpus and all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in cpus)
    ):
        raise ValueError("affinity must be a non-empty list of CPU numbers")
    idle = request.get("idle")
    if idle is not None:
        if isinstance(idle, bool) or not isinstance(idle, (int, float)):
            raise ValueError("idle must be a positive number of seconds")
        request["idle"] = clamp_idle(idle)
    return request


def clamp_idle(idle: float) -> float:
    """An idle time within (0, :data:`~spark_torch.settings.WARM_START_IDLE_MAX`]: the settings
    refuse more, and the template never trusts its clients to have checked (select() takes no
    timeout of 1e9 s or inf). ValueError for one that is not > 0 (nan included)."""
    value = float(idle)
    if not value > 0:
        raise ValueError(f"idle must be a positive number of seconds, got {value}")
    return min(value, WARM_START_IDLE_MAX)


def cold_reason(env: Mapping[str, str]) -> str | None:
    """Why no template can start this rank as a cold start would, or None."""
    for name in COLD_IF_NOT_ONE:
        if env.get(name, "1").strip() != "1":
            return f"{name}={env[name]} (numpy's thread pool is sized when numpy is imported)"
    return None
