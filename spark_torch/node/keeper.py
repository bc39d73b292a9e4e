"""A rank's keeper: the child subreaper between a node runner (or the warm-start template) and
the rank, so that nothing the rank starts can escape the run.

``python -m spark_torch.node.keeper MODULE ARGS...`` (a cold rank), or :func:`keep` in a child
of the warm-start template, marks its process a child subreaper (``PR_SET_CHILD_SUBREAPER``),
forks, and the child runs ``MODULE`` as ``python -m MODULE ARGS...`` would: the rank. Every
descendant of the rank that loses its parent (a double fork, a daemon, whatever its environment
or session) is re-parented to the keeper instead of init, so the node's stop finds it among the
keeper's descendants (:mod:`spark_torch.node.process_tree`) and the keeper reaps it. When the
rank exits, the keeper stops whatever the rank left (SIGTERM, a grace, SIGKILL), reaps it and
exits as the rank did: the same code, or killed by the same signal. The keeper is a dedicated
process, never the user's (a subreaper inherits zombies), ignores SIGTERM and SIGINT (the
rank's to handle; a stop's SIGKILL ends it), dies with its parent (``PR_SET_PDEATHSIG``) and
tells the rank to die with it (``SPARK_TORCH_PARENT_PID``). Standard library only.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import signal
import sys
import time
from typing import NoReturn

from spark_torch import envnames
from spark_torch.grace import RANK_GRACE_SECONDS

__all__ = ["keep", "main", "children_of", "KEEPER_MODULE"]

KEEPER_MODULE = "spark_torch.node.keeper"
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
#: after SIGKILL, how long the keeper waits to reap what the rank left
_KILL_WAIT_SECONDS = 5.0


def _prctl(option: int, value: int) -> bool:
    try:
        return int(ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def children_of(pid: int) -> list[int]:
    """The live children of ``pid`` (from /proc: no psutil in a rank's ancestor)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as fh:
                fields = fh.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != b"Z":  # fields[1]: ppid; Z: a zombie to reap, not to stop
            found.append(int(name))
    return found


def _reap(block: bool) -> tuple[int, int]:
    """Reap one child: ``(pid, status)``, ``(0, 0)`` if none is ready, ``(-1, 0)`` if none is left."""
    try:
        return os.waitpid(-1, 0 if block else os.WNOHANG)
    except ChildProcessError:
        return -1, 0
    except InterruptedError:  # pragma: no cover - PEP 475 retries; kept for clarity
        return 0, 0


def _stop_leftovers(grace: float) -> None:
    """SIGTERM whatever the rank left (re-parented here), ``grace`` to exit, SIGKILL the rest;
    every one reaped (bounded). Usually the rank left nothing: then no child is left to wait
    for, and no /proc scan is made."""
    while True:
        reaped, _ = _reap(block=False)
        if reaped < 0:  # no child at all, live or exited: nothing was left
            return
        if reaped == 0:  # a live child: the rank left something running
            break
    me = os.getpid()
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, _KILL_WAIT_SECONDS)):
        left = children_of(me)
        if not left:
            break
        for pid in left:
            with contextlib.suppress(OSError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while children_of(me) and time.monotonic() < deadline:
            if _reap(block=False)[0] == 0:
                time.sleep(0.02)
    while _reap(block=False)[0] > 0:
        pass


def _exit_as(status: int) -> NoReturn:
    """End this process as the rank ended: its exit code, or killed by its signal."""
    sys.stdout.flush()
    sys.stderr.flush()
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        with contextlib.suppress(OSError, ValueError):  # no core file of the keeper's own
            resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
        if sig not in (signal.SIGKILL, signal.SIGSTOP):  # these two have no handler to reset
            with contextlib.suppress(OSError, ValueError):
                signal.signal(sig, signal.SIG_DFL)
        with contextlib.suppress(OSError):
            os.kill(os.getpid(), sig)
        os._exit(128 + sig)  # a signal whose default is to be ignored
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


def _run_module(module: str, args: list[str]) -> NoReturn:
    """In the rank (the keeper's child): run ``module`` as ``python -m`` would, then exit."""
    code = 1
    try:
        os.environ[envnames.PARENT_PID] = str(os.getppid())  # the rank dies with its keeper
        sys.argv = ["-m", *args]
        import runpy

        sys.modules.pop(module, None)
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - as the interpreter would: the traceback, exit 1
        import traceback

        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def keep(module: str, args: list[str], grace: float = RANK_GRACE_SECONDS) -> NoReturn:
    """Become the rank's keeper (this process) and run ``module`` with ``args`` in a child."""
    if not _prctl(_PR_SET_CHILD_SUBREAPER, 1):  # not Linux: no keeper, the rank runs here
        _run_module_here(module, args)
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGTERM, signal.SIGINT)}
    pid = os.fork()
    if pid == 0:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _run_module(module, args)
    while True:
        reaped, status = _reap(block=True)
        if reaped == pid:
            break
        if reaped < 0:  # pragma: no cover - our own child cannot vanish unreaped
            status = 1 << 8
            break
    _stop_leftovers(grace)
    _exit_as(status)


def _run_module_here(module: str, args: list[str]) -> NoReturn:
    sys.argv = ["-m", *args]
    import runpy

    runpy.run_module(module, run_name="__main__", alter_sys=True)
    sys.exit(0)


def main(argv: list[str]) -> NoReturn:
    """``MODULE ARGS...``: die with the node runner, then keep the rank."""
    parent = os.environ.get(envnames.PARENT_PID, "")
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if parent.isdigit() and os.getppid() != int(parent):
        os._exit(137)  # the node runner is already gone
    if not argv:
        print("usage: python -m spark_torch.node.keeper MODULE [ARGS...]", file=sys.stderr)
        os._exit(2)
    keep(argv[0], argv[1:])


if __name__ == "__main__":
    main(sys.argv[1:])
