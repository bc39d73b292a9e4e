"""Inside a child the warm-start template forked: becoming the rank (or the store host).

The child starts a session, waits for the template's go (sent once its pid reached the node
runner), arms its death with the template, takes its descriptors as 0/1/2 and closes every
other, applies the runner's limits and umask, takes the rank's environment, directory,
``sys.argv`` and fresh random seeds, then runs the rank's module as ``python -m`` would.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import sys
from typing import Any, NoReturn

from spark_torch import envnames

__all__ = ["become_rank"]


def _close_other_fds(keep: set[int]) -> None:
    """Close every descriptor but ``keep``: nothing of the template reaches the rank."""
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd not in keep:
            with contextlib.suppress(OSError):
                os.close(fd)


def become_rank(request: dict[str, Any], fds: list[int], go: int, template: int) -> NoReturn:
    """In the forked child: turn into the rank described by ``request`` (never returns)."""
    code = 1
    try:
        os.setsid()  # first: the template can kill this child's group from now on
        if os.read(go, 1) != b"g":  # the runner never got our pid: do not run
            os._exit(1)
        os.close(go)
        _die_with_template(template)
        stdin, stdout, stderr, *extra = fds
        for fd, target in ((stdin, 0), (stdout, 1), (stderr, 2)):
            os.dup2(fd, target)
        _close_other_fds({0, 1, 2, *extra})
        for name, (soft, hard) in request.get("rlimits", {}).items():  # the runner's, as a cold rank's
            resource.setrlimit(getattr(resource, f"RLIMIT_{name}"), (soft, hard))
        if request.get("umask") is not None:
            os.umask(request["umask"])
        env = dict(request["env"])
        if extra:
            env[envnames.REPORT_FDS] = ",".join(str(fd) for fd in extra)
        env[envnames.PARENT_PID] = str(os.getppid())  # this template: it dies with the node runner
        os.environ.clear()
        os.environ.update(env)
        os.chdir(request["cwd"] or "/")
        _reseed_and_size_threads()
        module, *args = request["argv"]
        sys.argv = ["-m", *args]
        sys.path[0] = os.getcwd()  # what `python -m` puts first
        import runpy

        sys.modules.pop(module, None)  # imported by the template (warm bytecode); run it afresh as __main__
        runpy.run_module(module, run_name="__main__", alter_sys=True)  # ends with os._exit
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - a rank that could not start
        import traceback

        traceback.print_exc()
    os._exit(code)


def _die_with_template(template: int) -> None:
    """Every child dies with the template (SIGKILL), whatever module it runs: ranks arm this
    themselves too, the store host does not; exit now if the template is already gone."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != template:
        os._exit(1)


def _reseed_and_size_threads() -> None:
    """A fork inherits the template's random state and thread settings: make them the rank's."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.seed()
        threads = os.environ.get(envnames.THREAD_VARS[0], "")
        if threads.isdigit() and int(threads) > 0:
            torch.set_num_threads(int(threads))
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
