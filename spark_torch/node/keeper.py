"""A rank's keeper: the child subreaper between a node runner (or the warm-start template) and
the rank, so that nothing the rank starts can escape the run.

``python -m spark_torch.node.keeper MODULE ARGS...`` (a cold rank), or :func:`keep` in a child
of the warm-start template, marks its process a child subreaper (``PR_SET_CHILD_SUBREAPER``),
forks, and the child runs ``MODULE`` as ``python -m MODULE ARGS...`` would: the rank. Every
descendant of the rank that loses its parent (a double fork, a daemon, whatever its environment
or session) is re-parented to the keeper instead of init, so the node's stop finds it among the
keeper's descendants (:mod:`spark_torch.node.process_tree`) and the keeper reaps it. When the
rank exits, the keeper stops the whole tree the rank left, at any depth (SIGTERM to each
descendant, a grace, SIGKILL until none is left; what is re-parented to it meanwhile too), reaps it and
exits as the rank did: the same code, or killed by the same signal. The keeper is a dedicated
process, never the user's (a subreaper inherits zombies), ignores every signal it can (the
rank's to handle, and the rank may send any of them to its own process group, which the keeper
shares; a stop's SIGKILL ends it), dies with its parent (``PR_SET_PDEATHSIG``) and tells the
rank to die with it (``SPARK_TORCH_PARENT_PID``). Standard library only.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import sys
import time
from typing import Any, NoReturn

from spark_torch.base import envnames
from spark_torch.base.grace import RANK_GRACE_SECONDS
from spark_torch.base.prctl import become_subreaper, die_with_parent_thread

__all__ = ["keep", "main", "descendants_of", "ignored_signals", "KEEPER_MODULE"]

KEEPER_MODULE = "spark_torch.node.keeper"
#: after SIGKILL, how long the keeper waits to reap what the rank left
_KILL_WAIT_SECONDS = 5.0


def _process_table() -> dict[int, tuple[int, bool]]:
    """Every process now: pid -> (its parent, whether it is a zombie), from /proc (no psutil in
    a rank's ancestor)."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as fh:
                fields = fh.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        table[int(name)] = (int(fields[1]), fields[0] == b"Z")  # fields[1]: ppid; Z: a zombie
    return table


def descendants_of(pid: int) -> list[int]:
    """The live descendants of ``pid`` at any depth, whatever their session, group or
    environment (a zombie is left out, its children are not)."""
    by_parent: dict[int, list[int]] = {}
    table = _process_table()
    for child, (parent, _) in table.items():
        by_parent.setdefault(parent, []).append(child)
    found, todo = [], list(by_parent.get(pid, []))
    while todo:
        child = todo.pop()
        if not table[child][1]:
            found.append(child)
        todo.extend(by_parent.get(child, []))
    return found


def _reap(block: bool) -> tuple[int, int]:
    """Reap one child: ``(pid, status)``, ``(0, 0)`` if none is ready, ``(-1, 0)`` if none is left."""
    try:
        return os.waitpid(-1, 0 if block else os.WNOHANG)
    except ChildProcessError:
        return -1, 0
    except InterruptedError:  # pragma: no cover - PEP 475 retries; kept for clarity
        return 0, 0


def _reap_ready() -> bool:
    """Reap every child that has exited; whether any child (live or not yet reaped) is left."""
    while True:
        reaped, _ = _reap(block=False)
        if reaped < 0:
            return False
        if reaped == 0:
            return True


def _stop_leftovers(grace: float, kill_wait: float = _KILL_WAIT_SECONDS) -> None:
    """Stop the whole tree the rank left, at every depth: SIGTERM to every descendant (and to
    each one that appears later: re-parented here as its parent dies, or forked meanwhile) for
    up to ``grace``, then SIGKILL to every descendant, again and again, until none is left (up
    to ``kill_wait`` more: a process stuck in the kernel). Every child reaped. Usually the rank
    left nothing: then no child is left to wait for, and no /proc scan is made."""
    if not _reap_ready():
        return
    me = os.getpid()
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, kill_wait)):
        deadline = time.monotonic() + wait
        signalled: set[int] = set()
        while True:
            left = descendants_of(me)
            if not left:
                break
            for pid in left:
                # the SIGTERM once per process (a handler may be running); SIGKILL every round
                if sig == signal.SIGKILL or pid not in signalled:
                    with contextlib.suppress(OSError):
                        os.kill(pid, sig)
                        if sig == signal.SIGTERM:
                            os.kill(pid, signal.SIGCONT)  # a stopped process acts on it too
                    signalled.add(pid)
            if time.monotonic() >= deadline:
                break
            if not _reap_ready():
                continue
            time.sleep(0.02)
        if not left:
            break
    _reap_ready()


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


def ignored_signals() -> list[int]:
    """What the keeper ignores: every signal a process can catch, but SIGCHLD (its reaping).
    A rank may signal its own process group (``os.killpg(0, SIGUSR1)``: "checkpoint now" to
    its workers, SIGHUP, SIGTERM); the keeper is in that group and must outlive it. A stop's
    SIGKILL still ends it, and the parent-death signal too (SIGKILL)."""
    return sorted(int(sig) for sig in signal.valid_signals() if sig not in _NOT_IGNORED)


#: a signal the keeper cannot or must not ignore
_NOT_IGNORED = {signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD}


def _ignore_signals() -> dict[int, Any]:
    """Ignore :func:`ignored_signals` here; the handlers they had (for the rank to get back)."""
    previous: dict[int, Any] = {}
    for sig in ignored_signals():
        try:
            previous[int(sig)] = signal.signal(sig, signal.SIG_IGN)
        except (OSError, ValueError):  # one the interpreter may not touch (glibc's own): left as is
            continue
    return previous


def keep(module: str, args: list[str], grace: float = RANK_GRACE_SECONDS) -> NoReturn:
    """Become the rank's keeper (this process) and run ``module`` with ``args`` in a child."""
    if not become_subreaper():  # not Linux: no keeper, the rank runs here
        _run_module_here(module, args)
    previous = _ignore_signals()
    pid = os.fork()
    if pid == 0:
        for sig, handler in previous.items():  # the rank handles its signals as it would without a keeper
            with contextlib.suppress(OSError, ValueError, TypeError):
                signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
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
    die_with_parent_thread()
    if parent.isdigit() and os.getppid() != int(parent):
        os._exit(137)  # the node runner is already gone
    if not argv:
        print("usage: python -m spark_torch.node.keeper MODULE [ARGS...]", file=sys.stderr)
        os._exit(2)
    keep(argv[0], argv[1:])


if __name__ == "__main__":
    main(sys.argv[1:])
