"""Inside a child the warm-start template forked: becoming the rank (or the store host).

The child starts a session, waits for the template's go (sent once its pid reached the node
runner), arms its death with the template, takes its descriptors as 0/1/2 and closes every
other, applies the runner's limits (every one), umask and CPU affinity, takes the rank's environment,
directory, ``sys.argv`` and fresh random seeds, then stays as the rank's keeper
(:mod:`spark_torch.node.keeper`, a child subreaper) and runs the rank's module in its own child
as ``python -m`` would (the directory first on ``sys.path`` unless the interpreter runs with
``PYTHONSAFEPATH``).

A fork keeps the template's environment block, which is what /proc/PID/environ shows of the
child and of every process it forks: the node's orphan search
(:func:`~spark_torch.node.process_tree.find_marked`) would not see them. So the template starts
with :data:`~spark_torch.base.envnames.MARK_SLOT` as its last variable, and each child overwrites
that room in its own copy of the block with its node's marker (:func:`mark_environ`): a warm
rank and whatever it forks, in a session of its own or not, are found as a cold rank's are.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import sys
from collections.abc import Mapping
from typing import Any, NoReturn

from spark_torch.base import envnames
from spark_torch.base.prctl import die_with_parent_thread
from spark_torch.node.keeper import keep
from spark_torch.node.template.protocol import MARK_SLOT_VALUE

__all__ = ["become_rank", "environ_slot", "mark_environ", "with_mark_slot"]

#: the slot's entry in the template's environment block, as the kernel holds it
_SLOT_ENTRY = f"{envnames.MARK_SLOT}={MARK_SLOT_VALUE}".encode()


def _environ_block() -> tuple[int, bytes]:
    """Where this process's environment block starts in its memory, and what it holds now."""
    with open("/proc/self/stat", "rb") as fh:
        fields = fh.read().rsplit(b")", 1)[1].split()  # from field 3 (state) on: comm may hold spaces
    with open("/proc/self/environ", "rb") as fh:
        return int(fields[50 - 3]), fh.read()  # field 50: env_start (Linux 3.5)


def environ_slot() -> int:
    """The address of the marker slot's entry in this process's environment block (the
    template's, before any fork); OSError when it has none there or the kernel does not say."""
    try:
        start, block = _environ_block()
    except (OSError, ValueError, IndexError) as exc:
        raise OSError(f"cannot locate the environment block: {exc}") from None
    at = block.rfind(b"\0" + _SLOT_ENTRY + b"\0")
    if start <= 0 or at < 0:
        raise OSError(f"{envnames.MARK_SLOT} is not in the environment block")
    address = start + at + 1
    ctypes.memmove(address, _SLOT_ENTRY, len(_SLOT_ENTRY))  # writable? (the same bytes: a no-op)
    return address


def mark_environ(address: int, marker: Mapping[str, str]) -> None:
    """Write ``marker`` into the slot at ``address`` of this process's environment block (its
    own copy, after the fork: the template's is untouched), then check /proc shows it. Only
    the slot's bytes change; the rest of the room stays a filler variable."""
    entries = b"".join(f"{k}={v}\0".encode() for k, v in marker.items())
    room = len(_SLOT_ENTRY) - len(entries) - len(envnames.MARK_SLOT) - 1
    if room < 0 or any("\0" in k + v or "=" in k for k, v in marker.items()):
        raise ValueError(f"the node's marker does not fit the environment block: {marker}")
    data = entries + f"{envnames.MARK_SLOT}=".encode() + b"-" * room
    ctypes.memmove(address, data, len(data))
    shown = dict(e.split(b"=", 1) for e in _environ_block()[1].split(b"\0") if b"=" in e)
    if any(shown.get(k.encode()) != v.encode() for k, v in marker.items()):
        raise OSError("the node's marker does not show in /proc/self/environ")


def _close_other_fds(keep: set[int]) -> None:
    """Close every descriptor but ``keep``: nothing of the template reaches the rank."""
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd not in keep:
            with contextlib.suppress(OSError):
                os.close(fd)


def become_rank(request: dict[str, Any], fds: list[int], go: int, template: int, slot: int) -> NoReturn:
    """In the forked child: turn into the rank described by ``request`` (never returns);
    ``slot``: where to write its node's marker (:func:`environ_slot`)."""
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
        if request.get("affinity"):  # the runner's CPUs (its nice and oom_score_adj key the template)
            os.sched_setaffinity(0, request["affinity"])
        env = dict(request["env"])
        if extra:
            env[envnames.REPORT_FDS] = ",".join(str(fd) for fd in extra)
        env[envnames.PARENT_PID] = str(os.getppid())  # this template: it dies with the node runner
        os.environ.clear()  # unsetenv() each: nothing refers to the template's block any more
        os.environ.update(env)
        mark_environ(slot, {k: env[k] for k in envnames.NODE_MARKER if k in env})
        os.chdir(request["cwd"] or "/")
        _reseed_and_size_threads()
        module, *args = request["argv"]
        if not getattr(sys.flags, "safe_path", False):  # PYTHONSAFEPATH (3.11): `python -m` puts nothing first
            sys.path[0] = os.getcwd()  # what `python -m` puts first (the template's was "/")
        # this child stays as the rank's keeper (a child subreaper); the rank is its child
        keep(module, args)  # never returns
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - a rank that could not start
        import traceback

        traceback.print_exc()
    os._exit(code)


def _die_with_template(template: int) -> None:
    """Every child dies with the template (SIGKILL), whatever module it runs: ranks arm this
    themselves too, the store host does not; exit now if the template is already gone."""
    die_with_parent_thread()
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


def with_mark_slot() -> None:
    """Run with :data:`~spark_torch.base.envnames.MARK_SLOT` in the environment block the kernel
    holds (and every fork keeps), where each child writes its node's marker: if it is not there,
    exec this interpreter again, same pid and arguments, with it added last."""
    if os.environ.get(envnames.MARK_SLOT) == MARK_SLOT_VALUE:
        return
    env = {k: v for k, v in os.environ.items() if k != envnames.MARK_SLOT}
    env[envnames.MARK_SLOT] = MARK_SLOT_VALUE  # last: psutil reads a block's later duplicates over earlier ones
    os.execve(sys.executable, sys.orig_argv, env)
